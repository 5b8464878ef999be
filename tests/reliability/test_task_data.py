"""Task data that cannot be graded, and text the tokenizer cannot encode (issue 45, cases 9, 10 and 12).

- An empty gold answer (``"#### "``) used to pay the empty responses ``"#### "`` and ``"<answer></answer>"``.
- Non-ASCII questions were stripped silently on every policy: two Chinese questions both became ``"?\\n"`` and
  ``"Ünïcödé ≤ 5 × 2 ?"`` became ``"Unicode  5 * 2 ?"`` even for a tokenizer that encodes them.
- An answer without ``####``, a zero-row parquet, the same question with two gold answers and an unwritable
  ``datasets`` cache named neither the file and row nor the cause.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from ais_lightning.models import build_char_tokenizer
from ais_lightning.tasks import get_task

QUESTION = "What is 3+4?"


def gsm8k(tmp_path: Path, rows: list[dict], name: str = "rows.jsonl", **kwargs):
    path = tmp_path / name
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return get_task("gsm8k", path=str(path), use_datasets=False, **kwargs)


def keeps(tokenizer):
    from ais_lightning.tasks.base import tokenizer_keeps  # what ais-train fits a task with

    return tokenizer_keeps(tokenizer)


@pytest.fixture(scope="module")
def byte_level_tokenizer():
    """A byte-level BPE tokenizer (as SmolLM2's, Qwen's, GPT-2's), trained here on a few lines: it encodes any
    text, whatever its alphabet."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    backend = ByteLevelBPETokenizer()
    backend.train_from_iterator(
        ["What is 3+4? The answer is 7.", "苹果有几个?"], vocab_size=300, min_frequency=1
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend._tokenizer)


# ---------------------------------------------------------------------------------- case 9: an empty gold
def test_an_empty_gold_answer_is_refused_naming_the_file_and_row(tmp_path: Path):
    rows = [{"question": "What is 1+1?", "answer": "#### 2"}, {"question": QUESTION, "answer": "#### "}]
    with pytest.raises(ValueError) as err:
        gsm8k(tmp_path, rows)
    assert "rows.jsonl row 1: the gold answer after '####' is empty" in str(err.value), err.value


def test_an_empty_response_never_earns_a_reward(tmp_path: Path):
    task = gsm8k(tmp_path, [{"question": QUESTION, "answer": "#### 7"}])
    prompt = task.rows[0]["prompt"]
    completions = ["#### ", "<answer></answer>", "#### 7"]
    assert task.reward([prompt] * 3, completions) == [0.0, 0.0, 1.0]
    assert task.reward([prompt] * 2, completions[:2], answer=["", ""]) == [0.0, 0.0]  # an empty gold given


# ---------------------------------------------------------------------------------- case 10: non-ASCII text
CHINESE = [{"question": "苹果有几个?", "answer": "#### 3"}, {"question": "香蕉有几个?", "answer": "#### 4"}]
UNICODE = {"question": "Ünïcödé ≤ 5 × 2 ?", "answer": "#### 10"}


def test_text_a_tokenizer_encodes_is_kept_as_written(tmp_path: Path, byte_level_tokenizer):
    task = gsm8k(tmp_path, [*CHINESE, UNICODE])
    written = ["苹果有几个?\n", "香蕉有几个?\n", "Ünïcödé ≤ 5 × 2 ?\n"]
    assert [row["prompt"] for row in task.rows] == written  # loaded as written
    task.fit_text(keeps(byte_level_tokenizer))
    assert [row["prompt"] for row in task.rows] == written  # and kept: the tokenizer encodes every character


def test_questions_the_builtin_tokenizer_would_erase_are_refused_naming_them(tmp_path: Path):
    task = gsm8k(tmp_path, CHINESE)
    with pytest.raises(ValueError) as err:
        task.fit_text(keeps(build_char_tokenizer()))
    message = str(err.value)
    assert "2 question(s) keep no letter or digit" in message and "rows [0, 1]" in message, message
    assert "'苹果有几个?' -> '?\\n'" in message


def test_text_mapped_to_the_builtin_tokenizer_is_counted_in_a_warning(tmp_path: Path, caplog):
    task = gsm8k(tmp_path, [UNICODE, {"question": QUESTION, "answer": "#### 7"}])
    with caplog.at_level(logging.WARNING, logger="ais_lightning.tasks.gsm8k"):
        task.fit_text(keeps(build_char_tokenizer()))
    assert task.rows[0]["prompt"] == "Unicode  5 * 2 ?\n" and task.rows[1]["prompt"] == QUESTION + "\n"
    assert "1 of 2 rows hold characters the policy's tokenizer cannot encode" in caplog.text, caplog.text


def test_questions_the_mapping_makes_one_with_two_answers_are_refused(tmp_path: Path):
    rows = [{"question": "Café: 2+2?", "answer": "#### 4"}, {"question": "Cafe: 2+2?", "answer": "#### 5"}]
    task = gsm8k(tmp_path, rows)  # two questions as written
    with pytest.raises(ValueError, match=r"rows 0 and 1 once mapped ask the same question"):
        task.fit_text(keeps(build_char_tokenizer()))


# ------------------------------------------------------------------------- case 12: files that name nothing
def test_an_answer_without_hashes_is_refused_naming_the_row(tmp_path: Path):
    with pytest.raises(ValueError, match=r"rows\.jsonl row 0: the answer has no '####' final answer"):
        gsm8k(tmp_path, [{"question": QUESTION, "answer": "It is 7."}])


def test_one_question_with_two_gold_answers_is_refused_naming_both_rows(tmp_path: Path):
    rows = [{"question": QUESTION, "answer": "#### 7"}, {"question": "x", "answer": "#### 1"}]
    with pytest.raises(ValueError, match=r"rows 0 and 2 ask the same question 'What is 3\+4\?' .*'7', '8'"):
        gsm8k(tmp_path, [*rows, {"question": QUESTION + " ", "answer": "#### 8"}])
    gsm8k(tmp_path, [*rows, {"question": QUESTION, "answer": "#### 7.0"}])  # the same answer twice: fine


@pytest.mark.parametrize("use_datasets", [True, False])
def test_a_zero_row_parquet_is_named_as_such(tmp_path: Path, use_datasets: bool):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    if use_datasets:
        pytest.importorskip("datasets")
    path = tmp_path / "empty.parquet"
    pq.write_table(
        pa.table({"question": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), path
    )
    with pytest.raises(ValueError, match=r"empty\.parquet is a parquet table with no rows"):
        get_task("gsm8k", path=str(path), use_datasets=use_datasets, cache_dir=str(tmp_path / "cache"))


def test_an_unwritable_datasets_cache_is_named_with_the_way_out(tmp_path: Path):
    pytest.importorskip("datasets")
    blocker = tmp_path / "a_file"  # a cache under a regular file: unwritable even for root
    blocker.write_text("")
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"question": QUESTION, "answer": "#### 7"}) + "\n")
    with pytest.raises(ValueError) as err:
        get_task("gsm8k", path=str(path), use_datasets=True, cache_dir=str(blocker / "cache"))
    message = str(err.value)
    assert "the datasets library could not write its cache" in message, message
    assert "task.cache_dir" in message and "task.use_datasets=false" in message
