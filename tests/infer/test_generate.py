"""Mixed-soft-prompt generation: one left-padded batch, each row with its own trained prompt."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from _helpers import scaled_tiny_model, run_cli
from tunekit import TunekitError
from tunekit.methods import MethodConfig
from tunekit.infer.decode import encode_prompts, generate, generate_ids
from tunekit.commands.generate import main
from tunekit.methods import get_method
from tunekit.model import load_base_model

CPU = torch.device("cpu")
PROMPTS = ["What is two plus two?", "Hi", "Name a colour that is often used for the sky on a clear day.", "Hi"]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with weights scaled up (see _helpers.scaled_tiny_model)."""
    return scaled_tiny_model(tiny_model_dir, tmp_path_factory.mktemp("scaled-tiny"), seed=0)


@pytest.fixture(scope="module")
def fp32_model(model_dir):
    return load_base_model(str(model_dir), "none", torch.float32, CPU).eval()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def soft_prompts(fp32_model):
    """Two different soft prompts (3 and 6 virtual tokens) of embedding-like scale."""
    g = torch.Generator().manual_seed(0)
    table = fp32_model.get_input_embeddings().weight.detach()
    return [table[torch.randint(0, 1000, (3,), generator=g)], table[torch.randint(0, 1000, (6,), generator=g)]]


def hf_greedy(model, ids, soft, stop, pad, n):
    """Oracle for one row: transformers' own generate on [soft prompt | prompt] embeddings."""
    embeds = model.get_input_embeddings()(torch.tensor([ids]))
    if soft is not None:
        embeds = torch.cat([soft[None], embeds], dim=1)
    out = model.generate(inputs_embeds=embeds, attention_mask=torch.ones(embeds.shape[:2], dtype=torch.long),
                         max_new_tokens=n, do_sample=False, eos_token_id=stop, pad_token_id=pad)
    row = out[0].tolist()
    cut = next((j + 1 for j, t in enumerate(row) if t in stop), len(row))
    return row[:cut]


def test_mixed_batch_equals_each_row_alone(fp32_model, tokenizer, soft_prompts):
    a, b = soft_prompts
    rows = encode_prompts(tokenizer, PROMPTS)
    assert len({len(r) for r in rows}) > 1  # different lengths: left padding is exercised
    per_row = [a, b, None, a]  # includes a row with no soft prompt and the same prompt with another one
    stop, pad, n = [tokenizer.eos_token_id], tokenizer.pad_token_id, 8
    batched = generate_ids(fp32_model, rows, per_row, n, stop, pad)
    for ids, soft, got in zip(rows, per_row, batched):
        assert got == generate_ids(fp32_model, [ids], [soft], n, stop, pad)[0]
        assert got == hf_greedy(fp32_model, ids, soft, stop, pad, n)
    assert len({tuple(r) for r in batched}) == 4  # the same "Hi" under prompts a and b continues differently

    # a row stops at its first stop token; the others go on
    stop_at = batched[0][2]
    stopped = generate_ids(fp32_model, rows, per_row, n, [stop_at], pad)
    for full, got in zip(batched, stopped):
        assert got == (full[:full.index(stop_at) + 1] if stop_at in full else full)
    assert len(stopped[0]) == 3


def test_generate_api_uses_the_chat_template(fp32_model, tokenizer, soft_prompts):
    texts = generate(fp32_model, tokenizer, PROMPTS[:2], [soft_prompts[0], None], max_new_tokens=4)
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
    rendered = tokenizer.decode(encode_prompts(tokenizer, ["Hi"])[0])
    assert rendered.startswith("<|im_start|>") and rendered.rstrip().endswith("assistant")
    with pytest.raises(TunekitError, match="hidden size 64"):
        generate(fp32_model, tokenizer, ["Hi"], [torch.zeros(3, 32)])


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    """Two saved prompt-tuning adapters (different lengths, random init) and one for a wider model."""
    root = tmp_path_factory.mktemp("adapters")
    method = get_method("prompt_tuning")
    for name, n in (("a", 3), ("b", 5)):
        torch.manual_seed(len(name) + n)
        model = method.apply(load_base_model(str(model_dir), "none", torch.float32, CPU),
                             MethodConfig(name="prompt_tuning", num_virtual_tokens=n))
        method.save(model, root / name)
    wide = json.loads((root / "a" / "adapter_config.json").read_text())
    wide["token_dim"] = 32
    (root / "wide").mkdir()
    (root / "wide" / "adapter_config.json").write_text(json.dumps(wide))
    from safetensors.torch import save_file

    save_file({"prompt_embeddings": torch.zeros(3, 32)}, str(root / "wide" / "adapter_model.safetensors"))
    return root


def test_cli_mixes_adapters_in_one_batch(model_dir, adapters, fp32_model, tokenizer, tmp_path):
    from tunekit.methods.prompt_tuning import load_soft_prompt

    rows = [("Hi", adapters / "a"), ("What is two plus two?", adapters / "b"), ("Hi", None)]
    (tmp_path / "rows.jsonl").write_text("".join(
        json.dumps({"prompt": p, "adapter": str(a) if a else None}) + "\n" for p, a in rows))
    r = run_cli(["generate", "--model", str(model_dir), "--rows", str(tmp_path / "rows.jsonl"),
                 "--max-new-tokens", "6", "--dtype", "fp32", "--json"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    printed = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
    softs = [load_soft_prompt(a, 64) if a else None for _, a in rows]
    expected = generate(fp32_model, tokenizer, [p for p, _ in rows], softs, max_new_tokens=6)
    assert [row["completion"] for row in printed] == expected
    assert len(set(expected)) == 3 and all(expected)
    assert [row["adapter"] for row in printed] == [str(adapters / "a"), str(adapters / "b"), None]


@pytest.mark.parametrize("args, message", [
    (["--adapter", "{root}/missing", "--prompt", "Hi"], "--adapter: no such folder: {root}/missing"),
    (["--adapter", "{root}/wide", "--prompt", "Hi"], "{root}/wide: prompt_embeddings has shape (3, 32), this model has (3, 64)"),
    (["--adapter", "{root}/a", "--adapter", "{root}/b", "--prompt", "Hi"], "--adapter: 2 adapters for 1 prompts"),
    (["--adapter", "{root}/a"], "--prompt: give at least one"),
])
def test_bad_input_is_one_clear_error(args, message, tiny_model_dir, adapters):
    args = [a.format(root=adapters) for a in args]
    with pytest.raises(TunekitError) as err:
        main(["--model", str(tiny_model_dir), "--dtype", "fp32", *args])
    assert message.format(root=adapters) in str(err.value) and "\n" not in str(err.value)


def test_chat_samples_on_the_logits_device_reproducibly():
    """Nucleus sampling stays where the logits are (no copy of a vocabulary's logits to the host per
    token), is reproducible from its seed, and top_p below the top token's mass is greedy."""
    from torch.overrides import TorchFunctionMode

    from tunekit.commands.chat import sampler

    class NoHostCopy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            assert getattr(func, "__name__", "") not in {"cpu", "tolist", "item", "numpy"}, func
            return func(*args, **(kwargs or {}))

    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(0))
    with NoHostCopy():
        a = [sampler(1.0, 0.9, seed=7)(logits) for _ in range(2)]
    first = sampler(1.0, 0.9, seed=7)
    assert torch.equal(a[0], a[1]) and torch.equal(first(logits), a[0])  # same seed, same draws
    assert a[0].device == logits.device and a[0].shape == (3,)
    peaked = logits.clone()
    peaked[:, 42] = 50.0
    assert torch.equal(sampler(1.0, 0.5, seed=1)(peaked), torch.full((3,), 42))
