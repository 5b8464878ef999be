import json
import random
from fractions import Fraction
from pathlib import Path

import pytest

from ais_lightning.tasks import get_task
from ais_lightning.tasks.gsm8k import extract_answer, normalize_answer

SAMPLE = Path(__file__).with_name("gsm8k_sample.jsonl")


@pytest.fixture(scope="module")
def task():
    return get_task("gsm8k", path=str(SAMPLE), use_datasets=False)


def test_loads_sample_file(task):
    assert len(task.rows) == 10
    first = task.rows[0]
    assert first["prompt"] == "Tom has 3 apples and buys 4 more. How many apples does he have?\n"
    assert first["solution"] == "Tom has 3+4=7 apples.\n#### 7"  # calculator annotation removed
    assert first["answer"] == "7"
    assert task.rows[3]["answer"] == "1,500"
    assert task.rows[7]["prompt"].startswith("Café José sells")  # kept as written until fitted to a tokenizer


def test_datasets_backend_matches_plain_json(task, tmp_path):
    pytest.importorskip("datasets")
    loaded = get_task("gsm8k", path=str(SAMPLE), use_datasets=True, cache_dir=str(tmp_path))
    assert loaded.rows == task.rows


def test_parquet_file(task, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    rows = [json.loads(line) for line in SAMPLE.read_text(encoding="utf-8").splitlines()]
    path = tmp_path / "sample.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert get_task("gsm8k", path=str(path), use_datasets=False).rows == task.rows


def test_reward_formats_exact_values(task):
    completions = [
        "so 1200+300 = 1500.\n#### 1500",
        "The answer is \\boxed{1,500}.",
        "<answer>$1500</answer>",
        "<answer>1500 cars</answer>",
        "#### 1,500.",
        "#### 1499",
        "\\boxed{1400} ... no wait <answer>1500</answer>",  # boxed wins over <answer>
        "1500",  # no recognised final-answer format
        "",
    ]
    n = len(completions)
    prompt = task.rows[3]["prompt"]
    assert task.reward([prompt] * n, completions, answer=["1,500"] * n) == [1, 1, 1, 1, 1, 0, 0, 0, 0]


def test_reward_without_fields_looks_up_the_prompt(task):
    prompts = [task.rows[5]["prompt"], task.rows[8]["prompt"]]
    assert task.reward(prompts, ["#### 2.50", "\\boxed{-3}"]) == [1.0, 1.0]
    with pytest.raises(ValueError, match="not in"):
        task.reward(["unknown question\n"], ["#### 1"])


def test_sample_is_a_row_and_its_solution_scores_one(task):
    rng = random.Random(0)
    for _ in range(20):
        s = task.sample(rng)
        assert {"prompt": s.prompt, "solution": s.solution, "answer": s.fields["answer"]} in task.rows
        assert task.reward([s.prompt], [s.solution], answer=[s.fields["answer"]]) == [1.0]


def test_helpers():
    assert normalize_answer(" $1,234.50 ") == Fraction(2469, 2)
    assert normalize_answer("3/4") == Fraction(3, 4) and normalize_answer("abc") == "abc"
    assert extract_answer("a #### 5\n#### 6") == "6" and extract_answer("none") is None


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="path"):
        get_task("gsm8k")
    with pytest.raises(ValueError, match="not a local file"):
        get_task("gsm8k", path=str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "no final answer"}\n')
    with pytest.raises(ValueError, match="####"):
        get_task("gsm8k", path=str(bad), use_datasets=False)
    bad.write_text('{"question": "q"}\n')
    with pytest.raises(ValueError, match="answer"):
        get_task("gsm8k", path=str(bad), use_datasets=False)


BACKENDS = [pytest.param(False, id="json"), pytest.param(True, id="datasets")]


def _backend(use_datasets):
    if use_datasets:
        pytest.importorskip("datasets")
    return use_datasets


@pytest.mark.parametrize("use_datasets", BACKENDS)
def test_invalid_json_line_names_file_and_line(tmp_path, use_datasets):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"question": "q", "answer": "#### 1"})
    path.write_text(f'{good}\n\n{good}\n{{"question": "q", "answer" "#### 2"}}\n{good}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 4 is not valid JSON") as info:
        get_task("gsm8k", path=str(path), use_datasets=_backend(use_datasets), cache_dir=str(tmp_path / "c"))
    assert str(path) in str(info.value)


@pytest.mark.parametrize("use_datasets", BACKENDS)
@pytest.mark.parametrize("content", ["", "\n  \n"], ids=["empty", "blank"])
def test_empty_file_names_the_file(tmp_path, use_datasets, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=r"is empty") as info:
        get_task("gsm8k", path=str(path), use_datasets=_backend(use_datasets), cache_dir=str(tmp_path / "c"))
    assert str(path) in str(info.value)


def test_json_array_file_and_its_errors(tmp_path):
    rows = [json.loads(line) for line in SAMPLE.read_text(encoding="utf-8").splitlines()]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows, indent=1), encoding="utf-8")
    assert len(get_task("gsm8k", path=str(path), use_datasets=False).rows) == len(rows)
    path.write_text(json.dumps(rows, indent=1)[:-3], encoding="utf-8")
    with pytest.raises(ValueError, match=r"rows\.json is not valid JSON: .* at line \d+ column \d+"):
        get_task("gsm8k", path=str(path), use_datasets=False)
    path.write_text(json.dumps([rows[0], 3]), encoding="utf-8")
    with pytest.raises(ValueError, match=r"element 1 is not a JSON object"):
        get_task("gsm8k", path=str(path), use_datasets=False)


def test_non_object_line_and_non_utf8_file(tmp_path):
    path = tmp_path / "list.jsonl"
    path.write_text("[1, 2]\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"list\.jsonl line 1 is not a JSON object"):
        get_task("gsm8k", path=str(path), use_datasets=False)
    path.write_bytes(b'{"question": "\xff", "answer": "#### 1"}\n')
    with pytest.raises(ValueError, match=r"list\.jsonl is not UTF-8"):
        get_task("gsm8k", path=str(path), use_datasets=False)


def test_broken_parquet_names_the_file(tmp_path):
    pytest.importorskip("pyarrow")
    path = tmp_path / "bad.parquet"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"bad\.parquet is empty"):
        get_task("gsm8k", path=str(path), use_datasets=False)
    path.write_bytes(b"not a parquet file at all")
    with pytest.raises(ValueError, match=r"gsm8k file .*bad\.parquet could not be read"):
        get_task("gsm8k", path=str(path), use_datasets=False)
