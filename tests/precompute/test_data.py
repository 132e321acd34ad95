"""Dataset ingest: every accepted input, the loss-mask convention, max_length, routing."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import datasets
import numpy as np
import pytest

from mopd.base.errors import ConfigError
from mopd.config.precompute import DataConfig, RoutingConfig
from mopd.precompute import data
from mopd.precompute.data import tokenize_dataset
from mopd.precompute.ingest import ingest
from mopd.precompute.records import load_records
from mopd.precompute.routing import route
from mopd.precompute.rows import TokenizedRows
from tests.precompute.teachers import make_tokenizer, write_jsonl


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return make_tokenizer()


def tokenize(records: list[dict], tokenizer, num_proc: int | None = None, **config) -> TokenizedRows:  # type: ignore[no-untyped-def]
    ds = datasets.Dataset.from_list(records)
    return tokenize_dataset(
        ds,
        num_proc=num_proc,
        data=DataConfig(path="x", **config),
        routing=RoutingConfig(),
        agent_to_alias={"a": "a", "b": "b"},
        alias_index={"a": 0, "b": 1},
        tokenizer=tokenizer,
    )


def test_input_ids_with_and_without_mask(tokenizer) -> None:  # type: ignore[no-untyped-def]
    rows = tokenize(
        [
            {"agent": "a", "input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 0]},
            {"agent": "b", "input_ids": [9, 10, 11]},
        ],
        tokenizer,
    )
    assert rows.input_format == "input_ids"
    assert rows.input_ids[0].tolist() == [5, 6, 7, 8] and rows.loss_mask[0].tolist() == [0, 1, 1, 0]
    assert rows.loss_mask[1].tolist() == [1, 1, 0]  # every next token trains; the last position has none
    assert rows.teacher_index.tolist() == [0, 1]


def test_prompt_completion_trains_completion_only(tokenizer) -> None:  # type: ignore[no-untyped-def]
    rows = tokenize(
        [{"agent": "a", "prompt": "What is 3 plus 4?", "completion": " The answer is 7."}], tokenizer
    )
    prompt = tokenizer("What is 3 plus 4?")["input_ids"]
    completion = tokenizer(" The answer is 7.", add_special_tokens=False)["input_ids"]
    assert rows.input_ids[0].tolist() == prompt + completion
    # Position t predicts token t+1: the prompt's last position predicts the first completion token.
    expected = [0] * (len(prompt) - 1) + [1] * len(completion) + [0]
    assert rows.loss_mask[0].tolist() == expected


def test_messages_train_assistant_turns_only(tokenizer) -> None:  # type: ignore[no-untyped-def]
    messages = [
        {"role": "user", "content": "What is 1 plus 2?"},
        {"role": "assistant", "content": "The answer is 3."},
        {"role": "user", "content": "And 2 plus 2?"},
        {"role": "assistant", "content": "It is 4."},
    ]
    rows = tokenize([{"agent": "b", "messages": messages}], tokenizer)
    ids, mask = rows.input_ids[0], rows.loss_mask[0]
    assert ids.tolist() == list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
    trained_tokens = [int(ids[t + 1]) for t in np.flatnonzero(mask)]
    text = tokenizer.decode(trained_tokens)
    assert text == "The answer is 3.<|im_end|>\nIt is 4.<|im_end|>\n"


def test_text_and_max_length_policies(tokenizer) -> None:  # type: ignore[no-untyped-def]
    records = [
        {"agent": "a", "text": "def add_1(x, y):\n    return x + y * 1\n"},
        {"agent": "b", "text": "hi"},
    ]
    full = tokenize(records, tokenizer, max_length=1000)
    long = len(full.input_ids[0])
    cut = tokenize(records, tokenizer, max_length=long - 3)
    assert cut.num_truncated == 1 and cut.num_dropped == 0
    assert cut.input_ids[0].tolist() == full.input_ids[0][: long - 3].tolist()
    assert cut.loss_mask[0][-1] == 0 and cut.loss_mask[0][:-1].all()
    dropped = tokenize(records, tokenizer, max_length=long - 3, overlong="drop")
    assert dropped.num_dropped == 1 and dropped.num_rows == 1 and dropped.agents == ["b"]


def test_every_file_format_loads(tmp_path: Path) -> None:
    records = [{"agent": "a", "text": f"row {i}"} for i in range(3)]
    ds = datasets.Dataset.from_list(records)
    write_jsonl(tmp_path / "d.jsonl", records)
    ds.to_json(tmp_path / "d.json", lines=False)
    ds.to_parquet(tmp_path / "d.parquet")
    ds.save_to_disk(tmp_path / "saved")
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    for path in [
        tmp_path / "d.jsonl",
        tmp_path / "d.json",
        tmp_path / "d.parquet",
        tmp_path / "saved",
        arrow,
    ]:
        loaded = load_records(path)
        assert [r["text"] for r in loaded] == ["row 0", "row 1", "row 2"], path


def test_routing_default_and_unknown_agent() -> None:
    routing = RoutingConfig(default_teacher="b")
    assert route(["a", "zzz"], routing, {"a": "a"}, {"a": 0, "b": 1}) == [(0,), (1,)]
    with pytest.raises(ConfigError, match=r"row 1: agent 'zzz' has no teacher"):
        route(["a", "zzz"], RoutingConfig(), {"a": "a"}, {"a": 0})


def test_routing_to_sets_takes_each_teacher_once_and_a_rows_own_list_first() -> None:
    routing = RoutingConfig(teachers_field="teachers")
    table = {"a": ["x", "y", "x"], "b": "y"}
    index = {"x": 1, "x2": 1, "y": 0}
    own = [None, ["x2", "x"], None]
    assert route(["a", "a", "b"], routing, table, index, own=own) == [(0, 1), (1,), (0,)]
    with pytest.raises(ConfigError, match=r"row 7: its teachers list names alias 'z', not one of"):
        route(["a"], routing, table, index, row_ids=[7], own=[["x", "z"]])
    with pytest.raises(ConfigError, match=r"row 0: its teachers list is empty; correct the dataset"):
        route(["a"], routing, table, index, own=[[]])
    many = {f"t{i}": i for i in range(64)}
    with pytest.raises(ConfigError, match=r"row 0 has several teachers \(t0, t63\).* at most 63 teachers"):
        route(["a"], routing, {"a": ["t0", "t63"]}, many)


def test_a_rows_list_that_is_not_a_list_of_aliases_is_named() -> None:
    batch = {"teachers": [["x"], "x"]}
    with pytest.raises(ConfigError, match=r"row 5: teachers is 'x'; it holds a list of teacher aliases"):
        data.own_teachers(batch, RoutingConfig(teachers_field="teachers"), [4, 5])


def reference_fingerprint(rows: TokenizedRows) -> str:
    """The dataset fingerprint as stores of format 1 and 2 define it, row by row."""
    digest = hashlib.sha256()
    for ids, mask, teacher, key in zip(
        rows.input_ids, rows.loss_mask, rows.teacher_index, rows.source_keys, strict=True
    ):
        digest.update(np.int64(len(ids)).tobytes() + ids.astype("<i4").tobytes())
        digest.update(mask.astype(np.uint8).tobytes() + np.int64(teacher).tobytes() + key.encode() + b"\0")
    return digest.hexdigest()


def test_the_dataset_fingerprint_keeps_its_definition(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Over more rows than one hashing batch (8192), ids with and without keys, two teachers."""
    rng = np.random.default_rng(0)
    records = [
        {"agent": "ab"[i % 2], "input_ids": rng.integers(0, 400, size=1 + i % 7).tolist()}
        | ({"id": f"k{i}"} if i % 3 else {})
        for i in range(9000)
    ]
    rows = tokenize(records, tokenizer)
    assert rows.num_rows == 9000 and rows.fingerprint() == reference_fingerprint(rows)


def test_tokenising_in_several_processes_changes_nothing(tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    records = [{"agent": "ab"[i % 2], "text": f"row {i} says {'hi ' * (i % 5)}"} for i in range(50)]
    one = tokenize(records, tokenizer)
    monkeypatch.setattr(data, "_ROWS_PER_PROCESS", 1)
    environ = os.environ
    two = tokenize(records, tokenizer, num_proc=2)
    assert os.environ is environ  # what rich and others captured still is the environment
    assert two.table.equals(one.table) and two.fingerprint() == one.fingerprint()


def test_a_second_ingest_reads_the_first_ones_rows(tmp_path: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The second job tokenises nothing and gets the identical rows; what decides the rows (the source
    bytes, max_length) gives a new cache entry."""
    tokenizer.save_pretrained(tmp_path / "tok")
    source = write_jsonl(
        tmp_path / "d.jsonl", [{"agent": "ab"[i % 2], "text": f"row {i}"} for i in range(30)]
    )
    logs: list[str] = []

    def run(max_length: int = 100, *, tokenize_ok: bool = True) -> TokenizedRows:
        return ingest(
            data=DataConfig(path=str(source), max_length=max_length),
            routing=RoutingConfig(),
            agent_to_alias={"a": "a", "b": "b"},
            alias_index={"a": 0, "b": 1},
            tokenizer_path=str(tmp_path / "tok"),
            load_tokenizer=lambda: tokenizer if tokenize_ok else pytest.fail("tokenised again"),
            contexts={},
            cache=tmp_path / "cache",
            num_proc=None,
            show_progress=False,
            log=logs.append,
        )

    first = run()
    second = run(tokenize_ok=False)
    assert second.table.equals(first.table) and second.fingerprint() == first.fingerprint()
    assert second.fingerprint() == reference_fingerprint(second)
    assert "tokenised" in logs[0] and "reading the tokenised rows" in logs[1]
    assert len(list((tmp_path / "cache").iterdir())) == 1
    assert run(max_length=3).num_truncated == 30
    write_jsonl(source, [{"agent": "a", "text": "other"}])
    assert run().num_rows == 1
    assert len(list((tmp_path / "cache").iterdir())) == 3


def test_a_temporary_published_while_the_cache_is_listed_is_no_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Jobs of one store ingest at once: a job sweeping the cache for stale temporaries lists another
    job's temporary, which that job renames into place before the sweep looks at its age. The sweep
    goes on (and still removes a temporary left by a killed job an hour ago)."""
    from mopd.precompute import ingest as ingest_module

    cache = tmp_path / "cache"
    stale = cache / f"k1.tmp-{'0' * 32}"
    stale.mkdir(parents=True)
    os.utime(stale, (0, 0))
    published = cache / f"k2.tmp-{'1' * 32}"  # listed, then gone: renamed to its key by its job
    monkeypatch.setattr(Path, "iterdir", lambda self: iter([published, stale]))
    ingest_module._remove_stale(cache)
    assert not stale.exists()


def test_a_job_copies_only_published_ingest_records_into_a_bucket(tmp_path: Path) -> None:
    """Jobs of one bucket store share a machine's ingest cache: another job's temporary, holding its
    record until the rename, is not a record to copy (one renamed away between the listing and the read
    failed a job with FileNotFoundError, and one read in time would land in the bucket under a
    temporary's name)."""
    from mopd.precompute.ingest import publish_ingest_records
    from mopd.store.format.provenance import INGEST_DIR, INGEST_RECORD

    cache = tmp_path / "cache"
    for name in ("k1", f"k2.tmp-{'2' * 32}"):
        (cache / name).mkdir(parents=True)
        (cache / name / INGEST_RECORD).write_bytes(b"{}")

    class Bucket:
        def __init__(self) -> None:
            self.written: list[str] = []

        def local_folder(self) -> None:
            return None

        def write_same(self, key: str, data: bytes) -> None:
            self.written.append(key)

    bucket = Bucket()
    publish_ingest_records(bucket, cache)  # type: ignore[arg-type]
    assert bucket.written == [f"{INGEST_DIR}/k1/{INGEST_RECORD}"]
