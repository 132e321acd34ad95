"""bench/gpu.py's precompute section: `mopd precompute`'s hf backend on the GPU against CPU stores of the
same rows (see gpu.py's docstring)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

GIB = 2.0**30


def precompute_section(device: torch.device, small: bool) -> dict[str, Any]:
    import tempfile

    import yaml

    from mopd.cli.quickstart_assets import dataset_rows, first_blocks
    from mopd.config.mopd_config import load_config
    from mopd.precompute.hf_backend import HFTeacher
    from mopd.precompute.packaged_models import smollm2_checkpoint
    from mopd.precompute.runner import run_precompute
    from mopd.store import open_store

    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        teacher = smollm2_checkpoint()
        if small:  # toy size: the first 2 of its 30 blocks
            teacher = first_blocks(teacher, 2, root / "teacher")
        data = root / "rows.jsonl"
        rows = dataset_rows(22)[: 6 if small else 64]
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))

        def build(name: str, where: torch.device, dtype: str) -> tuple[Any, Any]:
            store = root / f"{name}.zarr"
            raw = {
                "teachers": dict.fromkeys(("math", "code", "chat"), str(teacher)),
                "data": {"path": str(data), "max_length": 512},
                "store": {"path": str(store), "dtype": dtype},
                "precompute": {"device": str(where), "dtype": dtype, "batch_tokens": 8192},
            }
            config = root / f"{name}.yaml"
            config.write_text(yaml.safe_dump(raw))
            result = run_precompute(load_config(config), show_progress=False, log=lambda _line: None)
            return result, open_store(store)

        cpu = torch.device("cpu")
        _, truth = build("cpu-fp32", cpu, "float32")
        _, cpu_bf16 = build("cpu-bf16", cpu, "bfloat16")
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        result, on_device = build("device-bf16", device, "bfloat16")
        peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else 0.0
        probe = HFTeacher(str(teacher), device=str(device), dtype="bfloat16", trust_remote_code=False)
        capture = probe.check_capture([on_device.row(i).input_ids.numpy() for i in range(4)])
        del probe
        errors = {"device": store_error(on_device, truth), "cpu": store_error(cpu_bf16, truth)}
    within = errors["device"]["mean_kl"] <= 2 * errors["cpu"]["mean_kl"]
    out = {
        "teacher": "SmolLM2-135M-Instruct" + (" (2 blocks)" if small else ""),
        "rows": len(rows),
        "tokens": int(truth.lengths.sum()),
        "tokens_per_s": result.tokens_per_s,
        "peak_gib": peak,
        "capture_rel_error": capture,
        "device_bf16_vs_fp32": errors["device"],
        "cpu_bf16_vs_fp32": errors["cpu"],
        "within_bf16_error": within,
    }
    print(f"  precompute: {out}", file=sys.stderr)
    return out


def store_error(store: Any, truth: Any) -> dict[str, float]:
    """A bf16 store against the fp32 one: the relative Frobenius error of the states, and of the
    teacher distributions rebuilt from them the mean per-token KL(truth ‖ store) and top-1 agreement."""
    num = den = kl = agree = 0.0
    tokens = 0
    for i in range(truth.num_rows):
        want, got = truth.hidden(i).double(), store.hidden(i).double()
        num += float((got - want).pow(2).sum())
        den += float(want.pow(2).sum())
        p = truth.teacher_logits(i).double().log_softmax(-1)
        q = store.teacher_logits(i).double().log_softmax(-1)
        kl += float((p.exp() * (p - q)).sum())
        agree += float((p.argmax(-1) == q.argmax(-1)).sum())
        tokens += want.shape[0]
    return {"state_rel_error": math.sqrt(num / den), "mean_kl": kl / tokens, "top1": agree / tokens}
