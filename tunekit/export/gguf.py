"""Write a merged Llama-architecture model as a GGUF file (llama.cpp's format) with `gguf`.

Layout llama.cpp's `llama` architecture reads (names per decoder block N):

    token_embd            model.embed_tokens             (vocab, dim)
    blk.N.attn_norm       input_layernorm                (dim,)          always f32
    blk.N.attn_q / attn_k self_attn.q_proj / k_proj      (heads*hd, dim) rows interleaved, see below
    blk.N.attn_v          self_attn.v_proj
    blk.N.attn_output     self_attn.o_proj
    blk.N.ffn_norm        post_attention_layernorm       (dim,)          always f32
    blk.N.ffn_gate/up/down  mlp.gate_proj / up_proj / down_proj
    output_norm           model.norm                     (dim,)          always f32
    output                lm_head                        omitted when tied to token_embd

Rotary layout: transformers' Llama rotates the pair (i, i + hd/2) of each head (rotate_half),
ggml's llama rope rotates adjacent pairs (2i, 2i + 1). So the rows of q and k (and their biases)
are reordered per head from [x_0..x_{hd/2-1}, y_0..y_{hd/2-1}] to [x_0, y_0, x_1, y_1, ...];
readers that go back to transformers (its GGUF loader) undo exactly this.

The tokenizer goes in as tokenizer.ggml.* (byte-level BPE = model "gpt2": tokens, token types,
merges, special ids, chat template). 1-D tensors stay f32 as llama.cpp expects; matrices are
stored in the requested dtype (bf16, f16 or f32).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from tunekit import TunekitError

BLOCK_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _types():
    import gguf

    return {
        "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
        "fp16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
        "fp32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    }


def interleave_rotary_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(n_heads * hd, ...) in rotate_half order -> the same shape with each head's rows interleaved."""
    hd = w.shape[0] // n_heads
    per_head = w.reshape(n_heads, 2, hd // 2, *w.shape[1:])  # (head, half, i, ...)
    return per_head.transpose(1, 2).reshape(w.shape)  # (head, i, half, ...)


def gguf_tensor_name(hf_name: str) -> str | None:
    """'model.layers.3.self_attn.q_proj.weight' -> 'blk.3.attn_q.weight'; None for unknown names."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    parts = hf_name.split(".")
    if parts[:2] != ["model", "layers"] or len(parts) < 5:
        return None
    block, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
    short = BLOCK_NAMES.get(module)
    return f"blk.{block}.{short}.{kind}" if short else None


def _check_llama(cfg) -> None:
    if cfg.model_type != "llama":
        raise TunekitError(f"--format gguf: only Llama-architecture models are supported, this is "
                           f"{cfg.model_type!r}; use --format merged")
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise TunekitError(f"--format gguf: rope scaling {rope.get('rope_type')!r} is not supported by this writer; "
                           "use --format merged")


def _rope_theta(cfg) -> float:
    rope = getattr(cfg, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def _add_model_metadata(w, cfg, name: str, file_type) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_name(name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(_rope_theta(cfg))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(file_type)


def _pre_tokenizer_name(tok_json: dict) -> str:
    """llama.cpp's name for the pre-tokenizer (its regex split), recognised by structure.

    llama.cpp picks its split regex by this name (llama-vocab.cpp) and refuses to load a file
    whose name it does not know. SmolLM2 splits digits one by one, then applies GPT-2's
    byte-level regex: llama.cpp calls that "smollm". Plain byte-level is "gpt-2" (with the
    hyphen: "gpt2" is the tokenizer *model* name, and llama.cpp rejects it as a pre-tokenizer).
    """
    pre = tok_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [(s.get("type"), s.get("individual_digits")) for s in steps]
    if kinds == [("Digits", True), ("ByteLevel", None)]:
        return "smollm"
    if kinds == [("ByteLevel", None)]:
        return "gpt-2"
    return "default"


def _add_tokenizer(w, tokenizer, vocab_size: int) -> None:
    """tokenizer.ggml.*: the byte-level BPE vocabulary, merges and special ids of `tokenizer`."""
    import gguf

    tok_json = json.loads(tokenizer.backend_tokenizer.to_str())
    model = tok_json["model"]
    if model.get("type") != "BPE":
        raise TunekitError(f"--format gguf: only byte-level BPE tokenizers are supported, this one is {model.get('type')}")
    id_to_token = {i: t for t, i in tokenizer.get_vocab().items()}
    added = {a["id"]: a for a in tok_json.get("added_tokens", [])}
    tokens, types = [], []
    for i in range(vocab_size):  # the embedding may have more rows than the tokenizer has tokens
        if i not in id_to_token:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(id_to_token[i])
            types.append(gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(id_to_token[i])
            types.append(gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(_pre_tokenizer_name(tok_json))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for setter, tid in ((w.add_bos_token_id, tokenizer.bos_token_id), (w.add_eos_token_id, tokenizer.eos_token_id),
                        (w.add_unk_token_id, tokenizer.unk_token_id), (w.add_pad_token_id, tokenizer.pad_token_id)):
        if tid is not None:
            setter(tid)
    w.add_add_bos_token(bool(getattr(tokenizer, "add_bos_token", False)))
    w.add_add_space_prefix(False)
    if tokenizer.chat_template:
        w.add_chat_template(tokenizer.chat_template)


def _numpy_type(ndim: int, dtype: str):
    """(numpy dtype, ggml type) a tensor of `ndim` dimensions is stored as. 1-D tensors stay f32."""
    import gguf

    if ndim == 1 or dtype == "fp32":
        return np.float32, gguf.GGMLQuantizationType.F32
    if dtype == "fp16":
        return np.float16, gguf.GGMLQuantizationType.F16
    return np.uint16, gguf.GGMLQuantizationType.BF16  # numpy has no bf16: the raw 16-bit patterns


def _as_numpy(t: torch.Tensor, dtype: str) -> np.ndarray:
    """A tensor as the array GGUFWriter stores (see _numpy_type). A tensor already in the stored
    16-bit dtype is taken as it is, without a fp32 copy of it (for the 128k x 4096 embedding of an
    8B model that copy is 2 GB); anything else is rounded once, to nearest even, by torch."""
    t = t.detach().cpu()  # the merged model may live on a GPU
    np_type, _ = _numpy_type(t.dim(), dtype)
    if np_type is np.float32:
        return t.float().contiguous().numpy()
    if np_type is np.float16:
        return (t if t.dtype == torch.float16 else t.float().half()).contiguous().numpy()
    # numpy has no bf16: the raw 16-bit patterns
    half = t if t.dtype == torch.bfloat16 else t.float().bfloat16()
    return half.contiguous().view(torch.int16).numpy().view(np.uint16)


def write_gguf(model: nn.Module, tokenizer, path: Path, dtype: str = "bf16", name: str = "tunekit-export") -> None:
    """Write `model` (a plain transformers LlamaForCausalLM, any float dtype) to the GGUF file `path`."""
    cfg = model.config
    state = model.state_dict()
    tied = bool(getattr(cfg, "tie_word_embeddings", False)) or (
        "lm_head.weight" in state and state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr())
    write_gguf_tensors(cfg, [(n, tuple(t.shape)) for n, t in state.items()], state.__getitem__, tied, tokenizer,
                       path, dtype, name)


def write_gguf_tensors(cfg, entries: list[tuple[str, tuple]], produce, tied: bool, tokenizer, path: Path,
                       dtype: str = "bf16", name: str = "tunekit-export") -> None:
    """Write a Llama model's tensors to the GGUF file `path`, one tensor in memory at a time.

    entries: (Hugging Face name, shape) in file order; produce(name) -> that tensor (any float
    dtype, any device), called once per written tensor, after the header is out: what a streamed
    merge computes (tunekit.export.stream) or a loaded model's state."""
    import gguf

    _check_llama(cfg)
    writer = gguf.GGUFWriter(str(path), "llama")
    _add_model_metadata(writer, cfg, name, _types()[dtype][1])
    _add_tokenizer(writer, tokenizer, cfg.vocab_size)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    written = []
    for hf_name, shape in entries:
        if hf_name == "lm_head.weight" and tied:
            continue  # llama.cpp reuses token_embd as the output head when `output` is absent
        out_name = gguf_tensor_name(hf_name)
        if out_name is None:
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue  # recomputed from rope.freq_base
            raise TunekitError(f"--format gguf: no GGUF name for tensor {hf_name!r} (not a plain Llama model?)")
        np_type, raw = _numpy_type(len(shape), dtype)
        writer.add_tensor_info(out_name, shape, np.dtype(np_type), int(np.prod(shape)) * np.dtype(np_type).itemsize,
                               raw_dtype=raw)
        written.append((hf_name, out_name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for hf_name, out_name in written:
        tensor = produce(hf_name)
        if ".attn_q." in out_name:
            tensor = interleave_rotary_rows(tensor, cfg.num_attention_heads)
        elif ".attn_k." in out_name:
            tensor = interleave_rotary_rows(tensor, cfg.num_key_value_heads)
        writer.write_tensor_data(_as_numpy(tensor, dtype))
        del tensor
    writer.close()
