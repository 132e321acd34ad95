"""examples/ configs are valid and cannot drift from what `mopd quickstart` runs."""

from __future__ import annotations

from pathlib import Path

import yaml

from mopd.cli.quickstart import FULL, quickstart_config
from mopd.config.mopd_config import load_config

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
IN_WORKDIR = "../mopd-quickstart/"


def _strip_workdir(raw: dict) -> dict:
    """The example with its paths made relative to the quickstart folder, as the quickstart writes them."""
    out = {**raw, "teachers": {k: v.removeprefix(IN_WORKDIR) for k, v in raw["teachers"].items()}}
    out["data"] = {**raw["data"], "path": raw["data"]["path"].removeprefix(IN_WORKDIR)}
    out["store"] = {**raw["store"], "path": raw["store"]["path"].removeprefix(IN_WORKDIR)}
    train = raw["train"]
    out["train"] = {
        **train,
        "student": train["student"].removeprefix(IN_WORKDIR),
        "output_dir": train["output_dir"].removeprefix(IN_WORKDIR),
    }
    for section in ("rollout", "rounds"):
        out[section] = {
            k: v.removeprefix(IN_WORKDIR) if isinstance(v, str) else v for k, v in raw[section].items()
        }
    return out


def test_the_quickstart_example_is_the_quickstarts_config() -> None:
    raw = yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text())
    assert _strip_workdir(raw) == quickstart_config(FULL)


def test_the_options_example_shares_the_quickstarts_store() -> None:
    quick = yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text())
    options = yaml.safe_load((EXAMPLES / "options.yaml").read_text())
    assert {k: v for k, v in options.items() if k != "train"} == {
        k: v for k, v in quick.items() if k not in ("train", "rollout", "rounds")
    }
    assert options["train"]["student"] == quick["train"]["student"]


def test_every_example_config_validates() -> None:
    configs = sorted(EXAMPLES.glob("*.yaml"))
    assert [c.name for c in configs] == ["options.yaml", "quickstart.yaml"]
    for config in configs:
        loaded = load_config(config)
        assert loaded.train is not None
        assert Path(loaded.store.path).parent.name == "mopd-quickstart"
