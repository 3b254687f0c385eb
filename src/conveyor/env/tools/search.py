"""A search tool over a local folder of documents, ranked by BM25.

Contract: ``search_tool(folder, k=3, max_chars=600) -> Tool`` named ``search`` with one
required string argument ``query``; it indexes the folder's ``.txt`` and ``.md`` files once,
at construction (a missing folder is a one-line ``ValueError``), and answers the top ``k``
documents with their best passage, at most ``max_chars`` characters.

It knows no embeddings, no stemming and no network: words in, ranked files out. The index
is the folder as it was at construction; files added later are not seen.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from conveyor.env.api import Tool, ToolError

SUFFIXES = (".txt", ".md")
PASSAGE_WORDS = 40
_WORD = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True)
class _Doc:
    name: str
    text: str
    spans: tuple[tuple[int, int], ...]  # character span of each token in ``text``
    tokens: tuple[str, ...]


class BM25:
    """Okapi BM25 over tokenized documents: ``scores(query_tokens)`` gives one score per document."""

    def __init__(self, docs: list[list[str]], k1: float = 1.5, b: float = 0.75):
        self.k1, self.b = k1, b
        self.tf = [Counter(d) for d in docs]
        self.len = [len(d) for d in docs]
        self.avg_len = (sum(self.len) / len(docs)) if docs else 0.0
        df = Counter(term for tf in self.tf for term in tf)
        n = len(docs)
        # The "+1" form of idf stays positive for terms in most documents.
        self.idf = {t: math.log(1.0 + (n - f + 0.5) / (f + 0.5)) for t, f in df.items()}

    def scores(self, query: list[str]) -> list[float]:
        terms = set(query)
        out = []
        for tf, length in zip(self.tf, self.len):
            norm = self.k1 * (1.0 - self.b + self.b * length / (self.avg_len or 1.0))
            s = 0.0
            for t in terms:
                f = tf.get(t, 0)
                if f:
                    s += self.idf[t] * f * (self.k1 + 1.0) / (f + norm)
            out.append(s)
        return out


def tokenize(text: str) -> list[str]:
    """Lowercase word tokens: runs of ASCII letters and digits."""
    return _WORD.findall(text.lower())


def search_tool(folder: str | Path, k: int = 3, max_chars: int = 600) -> Tool:
    """The ``search`` tool over the ``.txt`` / ``.md`` files under ``folder`` (indexed now).

    Contract: ``search_tool(folder, k=3, max_chars=600) -> Tool`` named ``search`` with one
    required string argument ``query``. At construction it reads every ``.txt`` and ``.md``
    file under ``folder`` (recursively, UTF-8 with replacement) and indexes it once; a missing
    folder raises a one-line ``ValueError`` naming it. A call ranks the documents by BM25
    (k1=1.5, b=0.75) over lowercase word tokens (``[a-z0-9]+``) and answers the top ``k``
    documents that share a term with the query, best first, one per line block:
    ``[1] <path relative to folder>: <snippet>``. The snippet is the best-matching passage
    of the document (a window of ``PASSAGE_WORDS`` words scored by the query terms' idf)
    with whitespace collapsed; the whole answer is at most ``max_chars`` characters (snippets
    are cut with ``...``). An empty folder or a query that matches nothing answers a sentence
    saying so; an empty query is a ``ToolError`` (bad_arguments).
    """
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise ValueError(f"search_tool folder {str(root)!r} is not a directory; pass a folder "
                         "holding .txt or .md documents")
    if k < 1 or max_chars < 80:
        raise ValueError(f"search_tool needs k >= 1 and max_chars >= 80, got k={k}, max_chars={max_chars}")
    docs = _read_docs(root)
    index = BM25([list(d.tokens) for d in docs])

    def search(query: str) -> str:
        if not isinstance(query, str) or not tokenize(query):
            raise ToolError("search: query has no words; pass e.g. 'capital of France'", "bad_arguments")
        if not docs:
            return f"no documents to search (the folder {root.name!r} has no .txt or .md files)"
        terms = tokenize(query)
        scores = index.scores(terms)
        ranked = sorted((i for i, s in enumerate(scores) if s > 0), key=lambda i: (-scores[i], docs[i].name))
        if not ranked:
            return f"no results for {query.strip()[:80]!r}"
        return _answer([docs[i] for i in ranked[:k]], terms, index.idf, max_chars)

    return Tool(
        name="search",
        description=f"Search {len(docs)} local documents; returns the {k} best matches "
                    "with a snippet each.",
        parameters={"type": "object",
                    "properties": {"query": {"type": "string", "description": "words to look for"}},
                    "required": ["query"], "additionalProperties": False},
        fn=search,
    )


def _read_docs(root: Path) -> list[_Doc]:
    docs = []
    for path in sorted(p for p in root.rglob("*") if p.suffix.lower() in SUFFIXES and p.is_file()):
        text = path.read_text(encoding="utf-8", errors="replace")
        matches = list(_WORD.finditer(text.lower()))
        docs.append(_Doc(path.relative_to(root).as_posix(), text,
                         tuple(m.span() for m in matches), tuple(m.group() for m in matches)))
    return docs


def _answer(hits: list[_Doc], terms: list[str], idf: dict[str, float], max_chars: int) -> str:
    lines = []
    budget = max_chars
    for rank, doc in enumerate(hits, 1):
        head = f"[{rank}] {doc.name}: "
        # Share what is left evenly among the results still to come.
        share = budget // (len(hits) - rank + 1) - len(head) - 1
        if share < 20:
            break
        snippet = _snippet(doc, terms, idf)
        if len(snippet) > share:
            snippet = snippet[:share - 3].rstrip() + "..."
        lines.append(head + snippet)
        budget -= len(lines[-1]) + 1
    return "\n".join(lines)


def _snippet(doc: _Doc, terms: list[str], idf: dict[str, float]) -> str:
    """The window of ``PASSAGE_WORDS`` words whose distinct query terms weigh most (idf),
    starting a few words before its first hit so the match opens the snippet."""
    query = set(terms)
    hits = [i for i, t in enumerate(doc.tokens) if t in query]
    if not hits:
        return _collapse(doc.text[:PASSAGE_WORDS * 8])
    best, best_score = hits[0], -1.0
    for start in hits:  # the best window starts at some hit
        window = set(doc.tokens[start:start + PASSAGE_WORDS]) & query
        score = sum(idf.get(t, 0.0) for t in window)
        if score > best_score:
            best, best_score = start, score
    first = max(0, best - 5)
    last = min(len(doc.tokens), first + PASSAGE_WORDS) - 1
    begin = doc.spans[first][0] if first > 0 else 0
    end = doc.spans[last][1]
    while end < len(doc.text) and not doc.text[end].isspace():  # keep the word's punctuation
        end += 1
    more = "..." if last < len(doc.tokens) - 1 else ""
    return ("..." if first > 0 else "") + _collapse(doc.text[begin:end]) + more


def _collapse(text: str) -> str:
    return " ".join(text.split())
