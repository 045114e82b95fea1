"""The shared method table: every PEFT method x every base (bf16, 4-bit NF4), on the tiny model.

For each row: only the method's own (added, fp32) parameters train; at initialisation the output
equals the base model's; save -> load into a fresh apply() reproduces the trained logits; merge()
gives a plain transformers model with the trained logits (and it survives save_pretrained /
from_pretrained), or a clear TunekitError where the method cannot merge.
A new method = one row in CASES.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

import bitsandbytes as bnb
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from _helpers import run_cli, tiny_args
from tunekit import TunekitError
from tunekit.methods import MethodConfig
from tunekit.losses import sft_loss_from_hidden
from tunekit.methods import available_methods, get_method, method_for_adapter
from tunekit.methods.prompt_tuning import init_token_ids, load_soft_prompt
from tunekit.model import decoder_and_head, load_base_model

CPU = torch.device("cpu")
DTYPE = torch.bfloat16  # the compute dtype of both bases in these tests

# Same function, different arithmetic: merged vs unmerged computes (W + BA) x instead of
# W x + B A x, and over NF4 an fp32 merged model replaces bf16 matmuls; peft's prompt tuning
# casts in another order. bf16 spacing for |logit| in [1, 2) is 2^-7 = 7.8e-3 (the tiny model's
# logits are ~1; measured max difference 3.9e-3), so 2 such steps plus torch's own bf16 rtol.
# (IA)^3 merged over bf16: x (l * W)^T with l * W rounded to bf16 (relative error <= 2^-9 per
# weight) against l * (x W^T) rounded twice (the matmul's output, then the scaled product:
# <= 2 * 2^-9 relative): each scaled projection's output differs by at most ~3 half-ulps
# (2^-8 relative), the same size as a merged LoRA's re-rounded sum, so the same 2 steps hold.
# fp32 leaves only summation order. Initialisation and save/load need no tolerance: same ops.
TOL = {
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
    torch.float32: dict(atol=1e-5, rtol=1e-5),
}


@dataclass
class Case:
    name: str
    overrides: dict = field(default_factory=dict)
    merges: bool = False
    # Prompt tuning is not the identity at init by design: initialised from a text, it must equal
    # the base run on that text's tokens (repeated/truncated to N) followed by the input.
    init_text: Optional[str] = None
    bases: tuple = ("none", "nf4")  # every PEFT method must train over a bf16 and a 4-bit base
    # Full fine-tuning trains the base's own weights (in fp32, so its init is the bf16 base up to
    # bf16 rounding) and saves a whole HF model rather than an adapter folder.
    trains_everything: bool = False
    exact_init: bool = True
    saved_files: tuple = ("adapter_config.json", "adapter_model.safetensors")
    merged_dtype: Optional[torch.dtype] = None  # None: fp32 over a 4-bit base, else the base dtype
    # AdamW's rate for the two training steps. (IA)^3's vectors are O(1) factors that move ~lr per
    # step: at 1e-2 two steps change the tiny model's logits by ~0.03, below the check's 0.1.
    lr: float = 1e-2


CASES = [
    Case("lora", {"r": 4, "alpha": 8, "dropout": 0.0}, merges=True),
    Case("adapter", {"bottleneck": 8}),
    Case("bitfit", merges=True),
    Case("prompt_tuning", {"num_virtual_tokens": 5, "prompt_init_text": "Answer briefly"}, init_text="Answer briefly"),
    Case("full", merges=True, bases=("none",), trains_everything=True, exact_init=False,
         saved_files=("config.json", "model.safetensors"), merged_dtype=torch.float32),
    Case("ia3", merges=True, lr=1e-1),
]
BASES = ["none", "nf4"]
ROWS = [pytest.param(case, quantize, id=f"{case.name}-{quantize}") for case in CASES for quantize in case.bases]


def test_table_covers_every_registered_method():
    assert sorted(c.name for c in CASES) == available_methods()


def make_base(model_dir, quantize: str):
    """A frozen base prepared the way the trainer prepares it (NF4 with gradient checkpointing, which
    re-runs every forward hook during backward)."""
    from tunekit.model import prepare_for_training

    model = load_base_model(str(model_dir), quantize, DTYPE, CPU)
    prepare_for_training(model, quantize, gradient_checkpointing=quantize == "nf4")
    return model


def make_batch() -> dict:
    """Two right-padded rows (lengths 7 and 4), labels = inputs on real positions."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(10, 1000, (2, 7), generator=g)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def hidden_logits(model, batch) -> torch.Tensor:
    """fp32 logits (n_real, vocab) of the real positions, through the trainer's decoder_and_head."""
    decoder, head = decoder_and_head(model)
    hidden = decoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    assert hidden.shape[:2] == batch["input_ids"].shape  # the trainer's (batch, seq, dim) contract
    return head(hidden.to(head.weight.dtype)).float()[batch["attention_mask"].bool()]


@torch.no_grad()
def eval_logits(model, batch) -> torch.Tensor:
    model.eval()
    out = hidden_logits(model, batch)
    model.train()
    return out


def reference_logits(base, batch, case: Case, model_dir) -> torch.Tensor:
    if case.init_text is None:
        return eval_logits(base, batch)
    n = case.overrides["num_virtual_tokens"]
    prefix = torch.tensor(init_token_ids(AutoTokenizer.from_pretrained(model_dir), case.init_text, n))
    ids = torch.cat([prefix.expand(2, -1), batch["input_ids"]], dim=1)
    mask = torch.cat([torch.ones(2, n, dtype=torch.long), batch["attention_mask"]], dim=1)
    base.eval()
    with torch.no_grad():
        decoder, head = decoder_and_head(base)
        hidden = decoder(input_ids=ids, attention_mask=mask).last_hidden_state[:, n:]
        out = head(hidden.to(head.weight.dtype)).float()[batch["attention_mask"].bool()]
    base.train()
    return out


def train_steps(model, batch, steps: int = 2, lr: float = 1e-2) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    model.train()
    for _ in range(steps):
        decoder, head = decoder_and_head(model)
        hidden = decoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        loss, n = sft_loss_from_hidden(hidden, head, batch["labels"])
        (loss / n).backward()
        opt.step()
        opt.zero_grad()


def assert_plain_transformers_model(model) -> None:
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, m in model.named_modules():
        assert not isinstance(m, (bnb.nn.Linear4bit, BaseTunerLayer)), name
        assert not type(m).__module__.startswith(("peft", "bitsandbytes", "tunekit")), name
        assert not m._forward_hooks and not m._forward_pre_hooks, f"{name} keeps a hook"
    assert not hasattr(model.config, "quantization_config")
    assert not any(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("case, quantize", ROWS)
def test_method(case: Case, quantize: str, tiny_model_dir, tmp_path):
    torch.manual_seed(0)
    cfg = MethodConfig(name=case.name, **case.overrides)
    method = get_method(case.name)
    batch = make_batch()

    base = make_base(tiny_model_dir, quantize)
    before = reference_logits(base, batch, case, tiny_model_dir)
    base_params = {id(p) for p in base.parameters()}
    model = method.apply(base, cfg)

    # Only what the method added trains, and it trains in fp32 whatever the base.
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    added = {n for n, p in model.named_parameters() if id(p) not in base_params}
    if case.trains_everything:
        assert trainable == {n for n, _ in model.named_parameters()}
    else:
        assert trainable and trainable == added
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)

    # Initialisation: exactly the base model's function (zero-initialised up/B/bias, or the init text).
    init = eval_logits(model, batch)
    torch.testing.assert_close(init, before, **(dict(atol=0, rtol=0) if case.exact_init else TOL[DTYPE]))

    train_steps(model, batch, lr=case.lr)
    trained = eval_logits(model, batch)
    assert (trained - init).abs().max() > 0.1  # the steps changed the function (measured ~0.7)

    # Save -> fresh base + apply -> load reproduces the trained model exactly.
    method.save(model, tmp_path / "adapter")
    for name in case.saved_files:
        assert (tmp_path / "adapter" / name).is_file(), name
    fresh = method.apply(make_base(tiny_model_dir, quantize), cfg)
    method.load(fresh, tmp_path / "adapter")
    torch.testing.assert_close(eval_logits(fresh, batch), trained, atol=0, rtol=0)
    if not case.trains_everything:  # ... and so does the folder alone: its method, its structure, its tensors
        found = method_for_adapter(tmp_path / "adapter")
        assert found.name == case.name
        opened = found.open_adapter(make_base(tiny_model_dir, quantize), tmp_path / "adapter")
        torch.testing.assert_close(eval_logits(opened, batch), trained, atol=0, rtol=0)

    if not case.merges:
        assert not method.can_merge
        with pytest.raises(TunekitError, match="--format adapter"):
            method.merge(model)
        return
    assert method.can_merge
    merged = method.merge(model)
    assert_plain_transformers_model(merged)
    assert merged.dtype == (case.merged_dtype or (torch.float32 if quantize == "nf4" else DTYPE))
    mask = batch["attention_mask"].bool()
    with torch.no_grad():
        merged_logits = merged(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()[mask]
    torch.testing.assert_close(merged_logits, trained, **TOL[DTYPE])
    # ... and it is an ordinary checkpoint: from_pretrained rebuilds the same model from its config
    merged.save_pretrained(tmp_path / "merged")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=merged.dtype)
    with torch.no_grad():
        again = reloaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()[mask]
    torch.testing.assert_close(again, merged_logits, atol=0, rtol=0)


def test_bitfit_merge_sets_llama_bias_flags(tiny_model_dir, tmp_path):
    """Training only q and down: the merged config turns on both bias flags and transformers then
    builds biases on all seven projections; the untrained ones are zero."""
    method = get_method("bitfit")
    model = method.apply(make_base(tiny_model_dir, "none"), MethodConfig(name="bitfit", target_modules=["q_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.fill_(0.5)
    merged = method.merge(model)
    merged.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["attention_bias"] is True and config["mlp_bias"] is True
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    block = reloaded.model.layers[1]
    for proj in (block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj, block.self_attn.o_proj,
                 block.mlp.gate_proj, block.mlp.up_proj, block.mlp.down_proj):
        assert proj.bias is not None
    assert torch.all(block.self_attn.q_proj.bias == 0.5) and torch.all(block.mlp.down_proj.bias == 0.5)
    assert torch.all(block.self_attn.k_proj.bias == 0) and torch.all(block.mlp.up_proj.bias == 0)


def test_bitfit_bias_stays_fp32_over_nf4(tiny_model_dir):
    """bitsandbytes casts a Linear4bit's own .bias to the input dtype in place; BitFit's is elsewhere."""
    model = get_method("bitfit").apply(make_base(tiny_model_dir, "nf4"), MethodConfig(name="bitfit"))
    train_steps(model, make_batch(), steps=1)
    biases = [p for n, p in model.named_parameters() if p.requires_grad]
    assert len(biases) == 2 * 7 and all(p.dtype == torch.float32 for p in biases)
    assert all(m.bias is None for m in model.modules() if isinstance(m, bnb.nn.Linear4bit))


@pytest.mark.parametrize("quantize", BASES)
def test_prompt_tuning_adapter_runs_in_peft(quantize, tiny_model_dir, tmp_path):
    """The saved folder is a peft PROMPT_TUNING adapter; peft's forward gives tunekit's logits."""
    from peft import PeftModel

    torch.manual_seed(0)
    method, batch = get_method("prompt_tuning"), make_batch()
    model = method.apply(make_base(tiny_model_dir, quantize), MethodConfig(name="prompt_tuning", num_virtual_tokens=4))
    train_steps(model, batch)
    ours = eval_logits(model, batch)
    method.save(model, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "PROMPT_TUNING" and config["task_type"] == "CAUSAL_LM"
    assert config["num_virtual_tokens"] == 4 and config["token_dim"] == 64 and config["num_transformer_submodules"] == 1
    assert config["prompt_tuning_init"] == "SAMPLE_VOCAB"
    peft_model = PeftModel.from_pretrained(make_base(tiny_model_dir, quantize), tmp_path)
    peft_model.eval()
    with torch.no_grad():
        theirs = peft_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    theirs = theirs[:, 4:].float()[batch["attention_mask"].bool()]  # peft returns the virtual positions too
    torch.testing.assert_close(theirs, ours, **TOL[DTYPE])


@pytest.mark.parametrize("quantize", BASES)
def test_ia3_adapter_runs_in_peft(quantize, tiny_model_dir, tmp_path):
    """The saved folder is a peft IA3 adapter: peft's IA3 layers rebuild the model and give tunekit's
    logits exactly (the same ops: (t * l) in fp32, rounded once to the stream's dtype). Over a 4-bit
    base peft 0.21's IA3 layer returns fp32 for a bf16 input (attention then refuses keys and values
    of another dtype than the queries), so there both sides compute in fp32."""
    from peft import PeftModel

    from tunekit.model import prepare_for_training

    torch.manual_seed(0)
    method, batch = get_method("ia3"), make_batch()
    dtype = DTYPE if quantize == "none" else torch.float32

    def base():
        model = load_base_model(str(tiny_model_dir), quantize, dtype, CPU)
        prepare_for_training(model, quantize, gradient_checkpointing=False)
        return model

    model = method.apply(base(), MethodConfig(name="ia3"))
    train_steps(model, batch, lr=1e-1)
    ours = eval_logits(model, batch)
    method.save(model, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "IA3" and config["task_type"] == "CAUSAL_LM"
    assert sorted(config["target_modules"]) == ["down_proj", "k_proj", "v_proj"]
    assert config["feedforward_modules"] == ["down_proj"]
    peft_model = PeftModel.from_pretrained(base(), tmp_path).eval()
    assert sum(1 for n, _ in peft_model.named_parameters() if ".ia3_l." in n) == 2 * 3
    with torch.no_grad():
        theirs = peft_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(theirs.float()[batch["attention_mask"].bool()], ours, atol=0, rtol=0)


def test_method_modules_import_no_torch():
    """The method.* schema is built from the registered methods whenever a command line is composed:
    a config error must not wait for torch, transformers and peft to import."""
    import subprocess
    import sys

    code = ("import sys, tunekit.config; heavy = sorted({'torch', 'peft', 'transformers'} & set(sys.modules)); "
            "assert not heavy, heavy")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_prompt_tuning_packed_rows_equal_padded(tiny_model_dir):
    """Packed rows (position_ids restarting per example) get the soft prompt before each example."""
    torch.manual_seed(0)
    model = get_method("prompt_tuning").apply(make_base(tiny_model_dir, "none"),
                                              MethodConfig(name="prompt_tuning", num_virtual_tokens=3))
    batch = make_batch()
    padded = eval_logits(model, batch)
    rows = [batch["input_ids"][0], batch["input_ids"][1, :4]]
    packed_ids = torch.cat(rows)[None]
    positions = torch.cat([torch.arange(len(r)) for r in rows])[None]
    decoder, head = decoder_and_head(model)
    model.eval()
    with torch.no_grad():
        hidden = decoder(input_ids=packed_ids, position_ids=positions).last_hidden_state
        packed = head(hidden).float()[0]
    assert hidden.shape[:2] == packed_ids.shape
    torch.testing.assert_close(packed, padded, **TOL[DTYPE])


def test_config_errors_name_the_key(tiny_model_dir):
    base = make_base(tiny_model_dir, "none")
    for name, overrides, key in [
        ("adapter", {"bottleneck": 0}, "method.bottleneck"),
        ("adapter", {"activation": "tanh"}, "method.activation"),
        ("adapter", {"sublayers": ["ffn"]}, "method.sublayers"),
        ("bitfit", {"target_modules": ["lm_head"]}, "method.target_modules"),
        ("prompt_tuning", {"num_virtual_tokens": 0}, "method.num_virtual_tokens"),
        ("prompt_tuning", {"prompt_init_text": ""}, "method.prompt_init_text"),
        ("ia3", {"target_modules": ["lm_head"]}, "method.target_modules: \\['lm_head'\\] are not Llama projections"),
        ("ia3", {"target_modules": ["k_proj"], "feedforward_modules": ["down_proj"]},
         "method.feedforward_modules: 'down_proj' is not one of method.target_modules"),
        ("lora", {"init": "svd"}, "method.init: unknown value 'svd'"),
        ("lora", {"loraplus_lr_ratio": -16.0}, "method.loraplus_lr_ratio: must be > 0"),
        ("lora", {"use_dora": "yes"}, "method.use_dora: must be true or false"),
        ("lora", {"init": "pissa", "use_dora": True}, "method.use_dora: not with method.init=pissa"),
    ]:
        with pytest.raises(TunekitError, match=key):
            get_method(name).apply(base, MethodConfig(name=name, **overrides))


def test_load_errors(tiny_model_dir, tmp_path):
    adapter = get_method("adapter")
    small = adapter.apply(make_base(tiny_model_dir, "none"), MethodConfig(name="adapter", bottleneck=4))
    adapter.save(small, tmp_path / "b4")
    big = adapter.apply(make_base(tiny_model_dir, "none"), MethodConfig(name="adapter", bottleneck=8))
    with pytest.raises(TunekitError, match="bottleneck"):
        adapter.load(big, tmp_path / "b4")
    with pytest.raises(TunekitError, match=r"no \*.safetensors file"):
        adapter.load(big, tmp_path / "missing")
    with pytest.raises(TunekitError, match="not a prompt-tuning"):
        load_soft_prompt(tmp_path / "b4", 64)
    with pytest.raises(TunekitError, match="no such folder"):
        load_soft_prompt(tmp_path / "missing", 64)


def test_new_recipes_train_from_the_cli(tiny_model_dir, tiny_data, tmp_path):
    """Every new recipe trains through the real CLI on a bf16 and on a 4-bit NF4 base (one sweep)."""
    out = tmp_path / "sweep"
    r = run_cli(["train", "-m", "recipe=adapter,bitfit,prompt_tuning,ia3", "model.quantize=none,nf4",
                 *tiny_args(tiny_model_dir, tiny_data, out, "trainer.max_steps=2", "trainer.eval_every=2",
                            "method.num_virtual_tokens=4", "method.bottleneck=8")], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = set()
    for job in range(8):
        d = out / str(job)
        cfg = (d / "config.yaml").read_text()
        recipe = cfg.split("\n")[0].split(": ")[1]
        quant = "nf4" if "quantize: nf4" in cfg else "none"
        seen.add((recipe, quant))
        summary = json.loads((d / "summary.json").read_text())
        assert summary["steps"] == 2 and summary["trainable_params"] > 0
        assert all(map(lambda v: v == v and abs(v) < 100, (summary["first_val_loss"], summary["last_val_loss"])))
        assert (summary["bits_per_param"] is not None) == (quant == "nf4")
        assert (d / "adapter" / "adapter_model.safetensors").is_file() and (d / "adapter" / "tokenizer.json").is_file()
    assert seen == {(r, q) for r in ("adapter", "bitfit", "prompt_tuning", "ia3") for q in ("none", "nf4")}


def test_a_key_the_chosen_method_does_not_read_is_refused():
    """method.r=4 with recipe=ia3 would train (IA)^3, which has no rank: refused in one line naming
    the key and the method's own keys, before anything loads."""
    from tunekit import TunekitError
    from tunekit.commands.compose import compose_configs
    from tunekit.methods import foreign_keys

    assert foreign_keys(MethodConfig(name="ia3", r=4, use_dora=True)) == ["method.r=4", "method.use_dora=True"]
    assert foreign_keys(MethodConfig(name="lora", r=4, use_dora=True)) == []
    assert foreign_keys(MethodConfig(name="ia3", target_modules=["k_proj"], feedforward_modules=[])) == []
    with pytest.raises(TunekitError, match=r"^method.r: method 'ia3' has no such key \(its keys: target_modules, "
                                           r"feedforward_modules\)"):
        compose_configs(["recipe=ia3", "method.r=4", "model.preset=llama-3-8b"])
    for recipe in ("qlora", "lora", "ia3", "adapter", "bitfit", "prompt_tuning", "distill"):
        compose_configs([f"recipe={recipe}", "model.preset=llama-3-8b"])  # the recipes as shipped set no foreign key
    # a -m sweep over methods: a key is left to the jobs whose method reads it, and refused if none does
    jobs = compose_configs(["-m", "recipe=lora,ia3", "method.r=8", "model.preset=llama-3-8b"])
    assert [(c.method.name, c.method.r) for c in jobs] == [("lora", 8), ("ia3", 8)]
    with pytest.raises(TunekitError, match=r"^method.r: method 'ia3' has no such key"):
        compose_configs(["-m", "recipe=ia3,bitfit", "method.r=8", "model.preset=llama-3-8b"])


def test_a_new_method_with_only_the_required_hooks_trains_on_a_stated_estimate(tiny_model_dir, tiny_data, tmp_path,
                                                                                caplog):
    """A method that has apply/owns/write/read and no planning hooks trains; the plan that sizes its
    run is the frozen base's, and the log says what it leaves out."""
    import math

    import torch.nn as nn
    from safetensors.torch import load_file, save_file

    from tunekit.config import DataConfig, ModelConfig, TrainConfig, TrainerConfig
    from tunekit.methods import registry
    from tunekit.plan import memory
    from tunekit.train.loop import TrainRecipe

    class Gain(registry.Method):
        """A trained gain on the final norm's output."""

        def apply(self, model, cfg):
            model.requires_grad_(False)
            norm = model.model.norm
            norm.register_parameter("toy_gain", nn.Parameter(torch.zeros(norm.weight.shape[0])))
            norm.register_forward_hook(lambda m, a, out: (out.float() * (1 + m.toy_gain)).to(out.dtype))
            return model

        def owns(self, name):
            return name.endswith("toy_gain")

        def write(self, model, out_dir):
            out_dir.mkdir(parents=True, exist_ok=True)
            save_file({k: p.detach().contiguous() for k, p in model.named_parameters() if self.owns(k)},
                      str(out_dir / "gain.safetensors"))

        def read(self, model, in_dir):
            model.load_state_dict(load_file(str(in_dir / "gain.safetensors")), strict=False)

    registry.register("toy_gain")(Gain)
    try:
        cfg = TrainConfig(
            output_dir=str(tmp_path / "run"), seed=0, method=MethodConfig(name="toy_gain"),
            model=ModelConfig(path=str(tiny_model_dir), quantize="none", gradient_checkpointing="auto"),
            data=DataConfig(path=str(tiny_data), max_seq_len=64, val_fraction=0.2, max_val_examples=2),
            trainer=TrainerConfig(max_steps=2, micro_batch_size=2, grad_accum=1, eval_every=100, save_every=100,
                                  eval_samples=0, lr=1e-2))
        r = TrainRecipe(cfg, tmp_path / "run")
        with caplog.at_level("INFO", logger="tunekit"):
            r.setup()
            rows = [r.train_step(step) for step in range(2)]
        gain = r.model.model.norm.toy_gain
        r.cleanup()
    finally:
        registry._REGISTRY.pop("toy_gain", None)
        memory._PLANNERS.pop("toy_gain", None)
    assert all(math.isfinite(row["loss"]) for row in rows) and gain.abs().max() > 0  # it trained
    assert "an estimate: method 'toy_gain' has no plan of its own" in caplog.text
