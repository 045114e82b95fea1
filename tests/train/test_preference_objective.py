"""PreferenceObjective (tunekit.train.preference) on plain tensors: a micro-batch of N pairs is 2N rows
scored in one pass, chosen first; the reference pass is asked for only by the losses that need one; the
step's reward sums become TRL's per-pair means (KTO: per desirable / undesirable row); and the config
checks refuse what cannot run, in one line each.

Both sides of each comparison run the same fp32 ops on the same tensors (the objective calls
sequence_logps and the loss functions the test calls), so they agree to summation order: atol 1e-6 on
values of magnitude <= 10."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tunekit import TunekitError
from tunekit.config import PreferenceConfig
from tunekit.losses.logps import sequence_logps
from tunekit.losses.preference import kto_loss, pair_losses
from tunekit.train.preference import PreferenceObjective, check_preference_config


def _batch(rows: int, **extra):
    g = torch.Generator().manual_seed(rows)
    labels = torch.randint(0, 40, (rows, 7), generator=g)
    labels[:, :3] = -100  # a 3-token prompt
    return {"input_ids": labels.clamp(min=0), "labels": labels, **extra}


def _head():
    torch.manual_seed(0)
    return torch.nn.Linear(8, 40, bias=False)


@pytest.mark.parametrize("loss", ["dpo", "ipo", "orpo", "simpo"])
def test_pairs_are_scored_in_one_pass_against_the_reference(loss):
    head, batch = _head(), _batch(6)
    hidden, ref_hidden = torch.randn(6, 7, 8), torch.randn(6, 7, 8)
    asked = []
    obj = PreferenceObjective(PreferenceConfig(loss=loss, beta=0.2), reference=lambda b: asked.append(b) or ref_hidden)
    total, n = obj.loss(hidden, head, batch)
    assert int(n) == 3 and obj.count(batch) == 3
    assert len(asked) == (0 if loss in ("orpo", "simpo") else 1)
    logps, tokens = sequence_logps(hidden, head, batch["labels"])
    ref, _ = sequence_logps(ref_hidden, head, batch["labels"])
    refs = (None, None) if loss in ("orpo", "simpo") else (ref[:3], ref[3:])
    want = pair_losses(loss, logps[:3], logps[3:], *refs, tokens[:3], tokens[3:], 0.2, 0.0, 0.5)
    torch.testing.assert_close(total, want.per_pair.sum(), atol=1e-6, rtol=0)
    stats = dict(zip(obj.stat_names, obj.take_stats("cpu").tolist()))
    margin = want.chosen_rewards - want.rejected_rewards
    means = obj.finish(stats, 3)
    assert means["rewards/chosen"] == pytest.approx(float(want.chosen_rewards.mean()), abs=1e-6)
    assert means["rewards/margins"] == pytest.approx(float(margin.mean()), abs=1e-6)
    assert means["rewards/accuracies"] == pytest.approx(float((margin > 0).float().mean()), abs=1e-6)
    assert obj.take_stats("cpu").abs().sum() == 0  # taken: the next step starts from zero


def test_kto_rewards_are_means_over_desirable_and_undesirable_rows():
    head = _head()
    desirable = torch.tensor([True, False, False, True, False])
    batch = _batch(5, desirable=desirable)
    hidden, ref_hidden = torch.randn(5, 7, 8), torch.randn(5, 7, 8)
    obj = PreferenceObjective(PreferenceConfig(loss="kto", kto_kl="zero"), reference=lambda b: ref_hidden)
    total, n = obj.loss(hidden, head, batch)
    assert int(n) == 5
    logps, _ = sequence_logps(hidden, head, batch["labels"])
    ref, _ = sequence_logps(ref_hidden, head, batch["labels"])
    want = kto_loss(logps, ref, desirable, 0.1)
    torch.testing.assert_close(total, want.per_pair.sum(), atol=1e-6, rtol=0)
    means = obj.finish(dict(zip(obj.stat_names, obj.take_stats("cpu").tolist())), 5)
    assert means["rewards/chosen"] == pytest.approx(float(want.chosen_rewards.mean()), abs=1e-6)  # over 2 rows
    assert means["rewards/rejected"] == pytest.approx(float(want.rejected_rewards.mean()), abs=1e-6)  # over 3


def _rows(seed: int, trained: bool = False):
    """A module-free model: each token's hidden state from a table of its own (so rows of other tokens get
    other states), a callable over a batch; `trained`: the table takes gradients."""
    table = torch.randn(40, 8, generator=torch.Generator().manual_seed(seed)).requires_grad_(trained)
    model = lambda rows: table[rows["input_ids"]]  # noqa: E731
    model.table = table
    return model


@pytest.mark.parametrize("policy_seed,clamped", [(1, False), (8, True)])
def test_kto_scores_against_the_kl_of_each_prompt_with_the_previous_rows_completion(policy_seed, clamped):
    """TRL's `kto`: the reference point is the mean log-ratio (policy over reference) of the micro-batch's
    mismatched rows, clamped at 0 and without gradient; held-out sums use 0 (module docstring)."""
    from tunekit.data.preference import collate_preference

    examples = [{"input_ids": [1, 2, 3, 10 + i, 11 + i, 12], "labels": [-100, -100, -100, 10 + i, 11 + i, 12],
                 "desirable": i % 2 == 0} for i in range(3)]
    examples[1] = {"input_ids": [4, 5, 20, 21], "labels": [-100, -100, 20, 21], "desirable": False}
    batch = collate_preference(examples, pad_id=0, kl_max_len=5)
    # row i: prompt i, then row i-1's completion (row 0 takes the last row's), cut to 5 tokens
    assert batch["kl_input_ids"].tolist() == [[1, 2, 3, 12, 13], [4, 5, 10, 11, 12], [1, 2, 3, 20, 21]]
    assert batch["kl_labels"].tolist() == [[-100, -100, -100, 12, 13], [-100, -100, 10, 11, 12],
                                           [-100, -100, -100, 20, 21]]
    head, policy, reference = _head(), _rows(policy_seed, trained=True), _rows(2)
    obj = PreferenceObjective(PreferenceConfig(loss="kto"), reference=reference)
    obj.policy = policy
    hidden = policy(batch)
    total, n = obj.loss(hidden, head, batch)
    kl_rows = {"input_ids": batch["kl_input_ids"]}
    pol, _ = sequence_logps(policy(kl_rows), head, batch["kl_labels"])
    ref, _ = sequence_logps(reference(kl_rows), head, batch["kl_labels"])
    kl = (pol - ref).mean()
    assert (kl < 0) == clamped  # both signs occur: seed 8's policy scores the mismatched rows below the reference
    logps, _ = sequence_logps(hidden, head, batch["labels"])
    ref_logps, _ = sequence_logps(reference(batch), head, batch["labels"])
    want = kto_loss(logps, ref_logps, batch["desirable"], 0.1, kl.clamp(min=0).detach())
    torch.testing.assert_close(total, want.per_pair.sum(), atol=1e-6, rtol=0)
    if not clamped:  # a real reference point: the loss differs from the zero-KL form's
        assert abs(float(total.detach() - kto_loss(logps, ref_logps, batch["desirable"], 0.1).per_pair.sum())) > 1e-4
    # the KL rows carry no gradient into the trained part: only the matched rows' log-ratios do
    (got,) = torch.autograd.grad(total, policy.table, retain_graph=True)
    (expected,) = torch.autograd.grad(want.per_pair.sum(), policy.table)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    means = obj.finish(dict(zip(obj.stat_names, obj.take_stats("cpu").tolist())), 3)
    assert means["kl"] == pytest.approx(max(float(kl), 0.0), abs=1e-6)
    sums, _ = obj.eval_sums(hidden, head, batch)
    zero = kto_loss(logps, ref_logps, batch["desirable"], 0.1)
    assert "kl" not in sums and float(sums["loss"]) == pytest.approx(float(zero.per_pair.sum()), abs=1e-6)


def _cfg(method="lora", init="default", loss="dpo", micro=4, **pref):
    return SimpleNamespace(objective="preference", preference=PreferenceConfig(loss=loss, **pref),
                           data=SimpleNamespace(packing=False, format="auto", path="pairs.jsonl"),
                           method=SimpleNamespace(name=method, init=init), trainer=SimpleNamespace(micro_batch_size=micro))


@pytest.mark.parametrize("cfg,culprit", [
    (_cfg(init="pissa"), "method.init: pissa starts the adapter away from zero"),
    (_cfg(method="prompt_tuning"), "method.name: preference.loss=dpo scores against the base"),
    (_cfg(loss="kto", label_smoothing=0.1), "preference.label_smoothing: 0.1 applies to preference.loss=dpo and simpo"),
    (_cfg(gamma=-1.0, loss="simpo"), "preference.gamma: must be >= 0, got -1"),
    (_cfg(undesirable_weight=0.0, loss="kto"), "preference.undesirable_weight: must be > 0, got 0"),
    (_cfg(loss="kto", kto_kl="mean"), "preference.kto_kl: "),
    (_cfg(loss="dpo", kto_kl="zero"), "preference.kto_kl: zero applies to preference.loss=kto only, not dpo"),
    (_cfg(loss="kto", micro=1), "trainer.micro_batch_size: 1 with preference.loss=kto: KTO's KL estimate pairs"),
])
def test_config_refusals_name_the_key(cfg, culprit):
    with pytest.raises(TunekitError) as e:
        check_preference_config(cfg)
    assert str(e.value).startswith(culprit)


def test_a_one_row_micro_batch_chosen_by_auto_is_refused_for_ktos_kl_only():
    from tunekit.train.preference import check_kto_micro_batch

    with pytest.raises(TunekitError, match=r"^trainer.micro_batch_size=auto: only 1 row a micro-batch fits"):
        check_kto_micro_batch(_cfg(loss="kto", micro=1), chosen_by_auto=True)
    check_kto_micro_batch(_cfg(loss="kto", micro=2), chosen_by_auto=True)
    check_kto_micro_batch(_cfg(loss="kto", micro=1, kto_kl="zero"), chosen_by_auto=True)
    check_kto_micro_batch(_cfg(loss="dpo", micro=1), chosen_by_auto=True)


def test_reference_free_losses_run_with_any_method():
    check_preference_config(_cfg(method="full", loss="orpo"))
    check_preference_config(_cfg(method="prompt_tuning", init="pissa", loss="simpo"))


def test_the_preference_keys_are_in_the_fingerprint_of_preference_runs_only():
    """A checkpoint saved before the preference node existed (an SFT run) must still resume: its
    fingerprint never had preference.* keys."""
    from tunekit.config import TrainConfig
    from tunekit.train.resume import fingerprint

    hashes = {"data.path:sha256": "x", "data.val_path:sha256": None}
    sft = TrainConfig()
    assert not [k for k in fingerprint(sft, 1, hashes) if k.startswith("preference.")]
    dpo = TrainConfig(objective="preference")
    assert fingerprint(dpo, 1, hashes)["preference.beta"] == 0.1


def test_precomputed_reference_logps_ride_in_the_batch_and_replace_the_reference_pass(tiny_model_dir):
    """preference.precompute_ref: rows carry (chosen, rejected) reference log-probs; the collated
    micro-batch holds them in its rows' order and the objective uses them instead of a reference forward."""
    from transformers import AutoTokenizer

    from tunekit.data.formats import Rows
    from tunekit.data.preference import PAIRS, collate_preference, tokenize_preference

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = Rows([{"prompt": f"q{i}", "chosen": f"yes {i}", "rejected": f"no {i}"} for i in range(2)], ["row 1", "row 2"])
    examples, _ = tokenize_preference(rows, PAIRS, "p.jsonl", tok, 64)
    for i, e in enumerate(examples):
        e["ref_logps"] = [-1.0 - i, -10.0 - i]
    batch = collate_preference(examples, tok.pad_token_id)
    assert batch["ref_logps"].tolist() == [-1.0, -2.0, -10.0, -11.0]  # chosen rows, then rejected
    obj = PreferenceObjective(PreferenceConfig(loss="dpo"), reference=lambda b: pytest.fail("reference forward"))
    assert obj._reference_logps(None, batch).tolist() == [-1.0, -2.0, -10.0, -11.0]


def test_a_reference_cache_that_does_not_fit_the_rows_is_named_and_not_used(tmp_path):
    """preference.precompute_ref's file kept with the run: read back only when it holds one finite fp32
    row of the right width per example; otherwise the run says why and computes them again."""
    from safetensors.torch import save_file

    from tunekit.train.preference import read_reference_cache, write_reference_cache

    pairs = [{"input_ids": [1], "rejected_input_ids": [2]}] * 3
    path = tmp_path / "ref.safetensors"
    assert read_reference_cache(path, pairs, pairs[:1]) == (None, None)  # no file: nothing to say
    train, val = torch.randn(3, 2), torch.randn(1, 2)
    write_reference_cache(path, train, val)
    got, why = read_reference_cache(path, pairs, pairs[:1])
    assert why is None and torch.equal(got[0], train) and torch.equal(got[1], val)
    _, why = read_reference_cache(path, pairs + pairs[:1], pairs[:1])  # another number of rows
    assert why == f"{path}: its 'train' log-probs are (3, 2) torch.float32, not (4, 2) finite float32"
    save_file({"train": torch.full((3, 2), float("nan")), "val": val}, str(path))
    assert "not (3, 2) finite float32" in read_reference_cache(path, pairs, pairs[:1])[1]
    path.write_bytes(b"not a safetensors file")
    assert read_reference_cache(path, pairs, pairs[:1])[1].startswith(f"{path}: unreadable")


def test_scored_rows_take_the_strategys_decoder_inputs_with_and_without_the_trained_part(monkeypatch):
    """The reference's forward and KTO's KL rows (RecipeSetup.reference_hidden / policy_hidden) feed the
    decoder what the strategy makes of the batch, as the training forward does: under FSDP a frozen
    untied embedding's sliced lookup (tunekit.train.fsdp.sliced_embeddings), never the table gathered
    whole. Only the reference switches the trained part off; neither records a graph."""
    import contextlib
    from types import SimpleNamespace

    import tunekit.model
    from tunekit.train.build import RecipeSetup

    embeds = torch.randn(2, 3, 4)
    seen, switched = [], []

    def decoder(**kwargs):
        seen.append((set(kwargs), torch.is_grad_enabled(), bool(switched)))
        return SimpleNamespace(last_hidden_state=kwargs["inputs_embeds"] * 2)

    @contextlib.contextmanager
    def switched_off(model):
        switched.append(1)
        yield
        switched.pop()

    strategy = SimpleNamespace(decoder_inputs=lambda model, dec, inputs: {
        **{k: v for k, v in inputs.items() if k != "input_ids"}, "inputs_embeds": embeds})
    recipe = SimpleNamespace(model=object(), strategy=strategy, method=SimpleNamespace(switched_off=switched_off))
    recipe._scored_hidden = lambda batch: RecipeSetup._scored_hidden(recipe, batch)
    monkeypatch.setattr(tunekit.model, "decoder_and_head", lambda model: (decoder, None))
    batch = {"input_ids": torch.zeros(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3), "labels": None}
    for scored in (RecipeSetup.reference_hidden, RecipeSetup.policy_hidden):
        assert torch.equal(scored(recipe, batch), embeds * 2)
    assert seen == [({"inputs_embeds", "attention_mask", "use_cache"}, False, True),
                    ({"inputs_embeds", "attention_mask", "use_cache"}, False, False)]
