"""W1's inputs, built locally: a randomly initialised Qwen2 model, a tokenizer, random prompts.

Contract
- ``build_w1_model(out_dir, shape_name, seed, dtype)`` writes a Qwen2
  causal LM with the shape ``bounds.SHAPES[shape_name]`` and seeded random
  weights, plus a byte-level BPE tokenizer with exactly the model's
  vocabulary size: ids 0-3 are ``<pad> <s> </s> <unk>``, then " ", the 52
  ASCII letters, and space-led letter words (" ab", " abc", ...), each
  reachable by merges, so transformers' Qwen2Tokenizer (which every "qwen2"
  checkpoint gets) loads it faithfully. No download: a random-init model
  measures a system exactly as well as real weights, and the GPU machines
  have no network.
- ``write_prompts(path, count, prompt_len, vocab, seed)`` writes a jsonl of
  prompts, each ``prompt_len`` random word ids (>= ``FIRST_WORD_ID``)
  spelled as " word word ...", so that every system's tokenizer call gives
  back exactly those ids (``check_prompt_roundtrip`` asserts it).
- Re-running with the same arguments reuses what is already there.

It does not know which system will load the model.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from benchmarks.bounds import SHAPES

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
SPACE = "\u0120"  # the byte-level alphabet's spelling of " "
FIRST_WORD_ID = len(SPECIALS) + 1 + 2 * len(LETTERS)  # first id of a " <letters>" token of 2+ letters


def _tokens_and_merges(vocab_size: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Byte-level BPE vocabulary: specials, " ", letters, then " x", " xy", " xyz", " xyzw" until full.

    Transformers loads any "qwen2" checkpoint's tokenizer as Qwen2Tokenizer, which rebuilds a
    byte-level BPE from the vocabulary and merges, so the vocabulary must be one: every word token
    is reached by a chain of merges (" " + x, then + y, ...), and a space-led run of letters is one
    pre-token, so each word of a prompt is exactly one id.
    """
    tokens = SPECIALS + [SPACE] + list(LETTERS)
    merges: list[tuple[str, str]] = []
    level = [SPACE]
    while len(tokens) < vocab_size:
        nxt = []
        for prefix in level:
            for ch in LETTERS:
                if len(tokens) == vocab_size:
                    break
                tokens.append(prefix + ch)
                merges.append((prefix, ch))
                nxt.append(prefix + ch)
        level = nxt
    return tokens, merges


def build_word_tokenizer(vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tokens, merges = _tokens_and_merges(vocab_size)
    tok = Tokenizer(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, unk_token=None,
                        continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    # The same normalizer / pre-tokenizer / decoder as Qwen2Tokenizer, so the saved file and the
    # class transformers rebuilds from it split text identically.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)


def prompt_text(ids: list[int], vocab_size: int) -> str:
    """Text whose tokenization is exactly ``ids`` (each id must be >= FIRST_WORD_ID)."""
    tokens, _ = _tokens_and_merges(vocab_size)
    return "".join(" " + tokens[i][1:] for i in ids)


def w1_config(shape_name: str):
    """The Qwen2 (or Llama) configuration of ``bounds.SHAPES[shape_name]``."""
    from transformers import LlamaConfig, Qwen2Config
    s = SHAPES[shape_name]
    if s.arch == "llama":
        return LlamaConfig(
            vocab_size=s.vocab, hidden_size=s.hidden, num_hidden_layers=s.layers, num_attention_heads=s.heads,
            num_key_value_heads=s.kv_heads, head_dim=s.head_dim, intermediate_size=s.ffn,
            max_position_embeddings=s.max_positions, tie_word_embeddings=s.tied, rope_theta=100_000.0,
            bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="sdpa",
        )
    return Qwen2Config(
        vocab_size=s.vocab, hidden_size=s.hidden, num_hidden_layers=s.layers, num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads, head_dim=s.head_dim, intermediate_size=s.ffn,
        max_position_embeddings=s.max_positions, tie_word_embeddings=s.tied, rope_theta=1_000_000.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="sdpa",
    )


def build_w1_model(out_dir: str | Path, shape_name: str, seed: int = 0, dtype: str = "bfloat16") -> Path:
    out = Path(out_dir)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM

    s = SHAPES[shape_name]
    config = w1_config(shape_name)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 2
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    build_word_tokenizer(s.vocab).save_pretrained(out)
    return out


def write_prompts(path: str | Path, count: int, prompt_len: int, vocab: int, seed: int = 0) -> Path:
    path = Path(path)
    rng = random.Random(f"w1-prompts-{seed}")
    tokens, _ = _tokens_and_merges(vocab)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(count):
            ids = [rng.randrange(FIRST_WORD_ID, vocab) for _ in range(prompt_len)]
            f.write(json.dumps({"prompt": "".join(" " + tokens[i][1:] for i in ids)}) + "\n")
    return path


def check_prompt_roundtrip(model_dir: str | Path, prompts_path: str | Path, prompt_len: int) -> None:
    """Raise if the checkpoint's tokenizer (as AutoTokenizer loads it) does not give prompt_len ids per prompt."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    with Path(prompts_path).open(encoding="utf-8") as f:
        first = json.loads(f.readline())["prompt"]
    ids = tok(first)["input_ids"]
    if len(ids) != prompt_len or min(ids) < FIRST_WORD_ID:
        raise RuntimeError(f"{type(tok).__name__} of {model_dir} turns a {prompt_len}-word prompt into {len(ids)} "
                           f"ids (min {min(ids) if ids else None}); the benchmark tokenizer did not load faithfully")
