"""Teachers and a student whose output layers are padded differently past one tokenizer (Qwen2.5-7B →
1.5B in miniature: teachers of 320 and 384 rows, a student of 288, a tokenizer of 259 tokens). The
divergence runs over the 259 real tokens: losses, per-token values and gradients equal an fp64
reference over the first 259 rows of each head, and a student with fewer rows than tokens is refused."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from mopd.cli.main import cli
from mopd.config.mopd_config import load_config
from mopd.precompute.runner import run_precompute
from mopd.store import open_store
from mopd.train.data.order import LoaderState
from mopd.train.trainer import Trainer, run_training
from tests.precompute.teachers import agent_records, make_tokenizer, save_teacher, write_jsonl
from tests.tolerance import U, assert_close, sum_rtol, value_atol

TOKENS = 259  # 256 byte-level symbols and 3 special tokens: a tokenizer with no merges


@dataclass(frozen=True)
class Padded:
    root: Path
    teachers: dict[str, Path]
    student: Path
    data: Path
    store: Path

    def config(self, folder: Path, *, student: Path | None = None, **train: object) -> Path:
        raw = {
            "teachers": {alias: str(path) for alias, path in self.teachers.items()},
            "data": {"path": str(self.data), "max_length": 64},
            "store": {"path": str(self.store), "dtype": "float32"},
            "precompute": {"rows_per_task": 8, "batch_tokens": 1024, "dtype": "float32"},
            "train": {
                "student": str(student or self.student),
                "steps": 2,
                "batch": {"micro_batch_tokens": 512, "global_batch_tokens": 512},
                "divergence": {"chunk_size": 32},
                "output_dir": str(folder / "run"),
                **train,
            },
        }
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.yaml").write_text(yaml.safe_dump(raw))
        return folder / "config.yaml"


@pytest.fixture(scope="module")
def padded(tmp_path_factory: pytest.TempPathFactory) -> Padded:
    root = tmp_path_factory.mktemp("padded")
    tokenizer = make_tokenizer(vocab_size=TOKENS)
    assert len(tokenizer) == TOKENS
    teachers = {
        "math": save_teacher(
            root / "t320", "qwen2", hidden_size=64, seed=31, tokenizer=tokenizer, output_rows=320
        ),
        "code": save_teacher(
            root / "t384", "qwen2", hidden_size=96, seed=32, tokenizer=tokenizer, output_rows=384
        ),
    }
    student = save_teacher(
        root / "s288", "qwen2", hidden_size=64, seed=33, tokenizer=tokenizer, output_rows=288
    )
    setup = Padded(
        root, teachers, student, write_jsonl(root / "d.jsonl", agent_records(16)), root / "store.zarr"
    )
    run_precompute(load_config(setup.config(root / "precompute")), show_progress=False, log=lambda _: None)
    return setup


def reverse_kl64(
    hidden_s: torch.Tensor, head_s: torch.Tensor, hidden_t: torch.Tensor, head_t: torch.Tensor
) -> torch.Tensor:
    """Per-token reverse KL over the first TOKENS rows of both heads, in fp64."""
    logp_s = (hidden_s @ head_s[:TOKENS].T).log_softmax(-1)
    logp_t = (hidden_t @ head_t[:TOKENS].T).log_softmax(-1)
    return (logp_s.exp() * (logp_s - logp_t)).sum(-1)


def test_the_objective_is_the_reference_over_the_real_vocabulary(padded: Padded, tmp_path: Path) -> None:
    trainer = Trainer(load_config(padded.config(tmp_path, lm_head_lifecycle="none")), log=lambda _l: None)
    store = open_store(padded.store)
    assert [t.vocab_size for t in store.teachers] == [320, 384] and trainer.student.output_rows == 288
    assert trainer.objective.vocab_size == TOKENS == store.manifest.tokenizer.vocab_size
    mb = next(trainer.loader.steps(LoaderState(0))).microbatches[0]
    assert set(mb.teacher_hidden) == {0, 1}
    hidden = trainer.student.hidden_states(mb.input_ids, mb.attention_mask)[mb.loss_mask].detach()
    hidden.requires_grad_()
    head = trainer.student.head
    norm = torch.full((mb.num_trained,), 1.0 / mb.num_trained)
    loss, per_token = trainer.objective(hidden, head, mb, norm)[:2]
    loss.backward()

    h64 = hidden.detach().double().requires_grad_()
    w64 = head.detach().double().requires_grad_()
    want = torch.zeros(mb.num_trained, dtype=torch.float64)
    for t in (0, 1):
        sel = mb.teacher_index == t
        teacher_head = store.lm_head(t).double()
        want[sel] = reverse_kl64(h64[sel], w64, mb.teacher_hidden[t].double(), teacher_head)
    (norm.double() * want).sum().backward()
    gap = max(float(mb.teacher_hidden[t].abs().max()) for t in (0, 1)) * 4  # a generous logit range
    assert_close(per_token, want.detach(), atol=value_atol(TOKENS, gap), what="per_token")
    assert_close(loss, (norm.double() * want).sum(), atol=value_atol(TOKENS, gap), what="loss")
    rtol = 2 * sum_rtol(96 + TOKENS + mb.num_trained)  # logits, softmax, the head's sum over tokens
    assert_close(hidden.grad, h64.grad, rtol=rtol, norm=True, what="grad_hidden")
    assert_close(head.grad[:TOKENS], w64.grad[:TOKENS], rtol=rtol, norm=True, what="grad_head")
    assert torch.equal(head.grad[TOKENS:], torch.zeros_like(head.grad[TOKENS:]))  # padding: no gradient
    trainer.student.close()


def repadded(source: Path, folder: Path, rows: int, seed: int) -> Path:
    """A copy of `source` with its embedding and output layer re-padded to `rows` rows of noise past the
    tokenizer: the same model over every real token."""
    import shutil

    shutil.copytree(source, folder)
    weights = load_file(folder / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        real = weights[name][:TOKENS]
        noise = torch.randn(rows - TOKENS, real.shape[1], generator=generator) * 5.0
        weights[name] = torch.cat([real, noise]).contiguous()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": rows}))
    return folder


def test_self_distillation_across_paddings_is_zero(padded: Padded, tmp_path: Path) -> None:
    """The 320-row teacher distilled into itself re-padded to 288 rows of other noise: every token's KL
    stays within fp32's rounding of zero."""
    teacher = padded.teachers["math"]
    student = repadded(teacher, tmp_path / "self288", 288, seed=5)
    one = Padded(
        padded.root, {"math": teacher, "code": teacher}, student, padded.data, tmp_path / "self.zarr"
    )
    config = load_config(one.config(tmp_path))
    run_precompute(config, show_progress=False, log=lambda _: None)
    record = run_training(config, max_steps=1, log=lambda _line: None).records[0]
    # KL(p ‖ p) is second order in the log-probabilities' differences; its fp32 value errs by at most
    # Σ_v p_v · 2U·|log p_v| = 2U·H(p) ≤ 2U·ln V (each log-probability rounds once on either side).
    bound = 2 * U * math.log(TOKENS)
    assert bound <= 1e-6
    assert_close(
        [record["divergence_min"], record["divergence_max"]], [0.0, 0.0], atol=bound, what="min, max"
    )


def test_a_student_with_fewer_rows_than_tokens_is_refused(padded: Padded, tmp_path: Path) -> None:
    tokenizer = make_tokenizer(vocab_size=TOKENS)
    short = save_teacher(
        tmp_path / "s200", "qwen2", hidden_size=64, seed=34, tokenizer=tokenizer, output_rows=200
    )
    config = padded.config(tmp_path, student=short)
    result = CliRunner().invoke(cli, ["train", str(config)])
    assert result.exit_code == 1
    # What train was doing (the store it opened, the student it loaded), then the error in one line.
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and result.stderr.rstrip().endswith(errors[0]), result.stderr
    assert "Traceback" not in result.stderr
    assert "its output layer has 200 rows, fewer than the 259 tokens" in errors[0]


def test_inspect_shows_padded_and_real_vocabularies(padded: Padded) -> None:
    result = CliRunner().invoke(cli, ["inspect", str(padded.store)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert [line.split(", ")[-1] for line in lines if "fingerprint" in line] == [
        "output rows 320",
        "output rows 384",
    ]
    assert "the tokenizer has 259 tokens" in " ".join(result.stdout.split())
    summary = json.loads(CliRunner().invoke(cli, ["inspect", str(padded.store), "--json"]).stdout)
    assert [t["vocab_size"] for t in summary["teachers"]] == [320, 384] and summary["vocab_size"] == 259


def test_a_student_of_another_tokenizer_is_refused(padded: Padded, tmp_path: Path) -> None:
    other = save_teacher(
        tmp_path / "other", "qwen2", hidden_size=64, seed=35, tokenizer=make_tokenizer(vocab_size=300)
    )
    result = CliRunner().invoke(cli, ["train", str(padded.config(tmp_path, student=other))])
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert "has another tokenizer vocabulary than the store" in " ".join(result.stderr.split())
