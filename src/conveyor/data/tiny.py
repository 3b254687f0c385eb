"""Build a tiny Hugging Face model and a character-level tokenizer, locally.

Contract: ``build_tiny(out_dir, cfg)`` writes a Llama- (or Qwen2-) architecture
causal LM with UNTIED embeddings and random weights (with ``num_experts > 0``: a
Qwen3-MoE model whose every layer's MLP is ``num_experts`` experts of width
``moe_intermediate_size``, ``experts_per_token`` of them per token) plus a matching
``PreTrainedTokenizerFast`` (one token per printable ASCII character, special
tokens for BOS/EOS/PAD and the chat roles, a chat template) with
``save_pretrained``. Everything loads back with ordinary ``from_pretrained``,
so the rest of conveyor treats it exactly like a real checkpoint. No network.
"""
from __future__ import annotations

import string
from pathlib import Path

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer():
    """Character-level tokenizer: every printable ASCII char is one token."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    # A BPE model with no merges splits text into single characters; with no
    # pre-tokenizer, spaces and newlines are ordinary characters too.
    tok = Tokenizer(BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(SPECIALS)
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>", chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False,
    )


def build_model(tokenizer, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                intermediate_size=384, max_position_embeddings=256, arch="llama", seed=0,
                num_experts=0, experts_per_token=2, moe_intermediate_size=None):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3MoeConfig

    moe = {}
    if num_experts > 0:  # the Qwen3-MoE shape: every layer sparse, top-k weights renormalised
        arch = "qwen3_moe"
        moe = {"num_experts": num_experts, "num_experts_per_tok": experts_per_token, "norm_topk_prob": True,
               "moe_intermediate_size": moe_intermediate_size or intermediate_size, "decoder_sparse_step": 1,
               "mlp_only_layers": [], "head_dim": hidden_size // num_heads}
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3_moe": Qwen3MoeConfig}[arch]
    config = cls(
        vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,  # the tests' real model (SmolLM2) covers tied embeddings
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, rope_theta=10000.0, attn_implementation="sdpa", **moe,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model


def build_tiny(out_dir: str | Path, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
               intermediate_size=384, max_position_embeddings=256, arch="llama", seed=0,
               num_experts=0, experts_per_token=2, moe_intermediate_size=None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    model = build_model(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
                        max_position_embeddings, arch, seed, num_experts, experts_per_token,
                        moe_intermediate_size)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
