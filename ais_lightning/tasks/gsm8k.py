"""GSM8K-format math word problems from a LOCAL file (never the network).

The file is jsonl (or parquet) with ``"question"`` and ``"answer"`` fields, as in GSM8K (Cobbe et
al. 2021, arXiv 2110.14168): the answer is worked reasoning ending in ``"#### <number>"``. The gold
answer is the text after the last ``"####"``; the reference solution is the answer with GSM8K's
calculator annotations ``<<48/2=24>>`` removed. A file that cannot be graded is refused naming the file
and the row: an answer without ``####`` or with nothing after it, the same question twice with different
gold answers. Text is kept as written unless the policy's tokenizer cannot encode some of its characters
(:meth:`GSM8K.fit_text`): those are mapped (``é`` -> ``e``) with a warning that counts the rows changed, and
rows the mapping makes ungradable (a question with no letter or digit left, two questions made one) are
refused.

The reward accepts the final answer as ``\\boxed{...}``, ``<answer>...</answer>`` or ``#### ...``
(checked in that order, last occurrence of the first format present); numbers are compared
exactly after removing commas, ``$`` and spaces (:func:`ais_lightning.tasks.answers.normalize_answer`).
1.0 on a match, else 0.

In the chat format (``format="chat"``) the prompt asks for the answer in ``\\boxed{}``
(``"<question>\\nPut the final answer in \\boxed{}."``), the reference solution ends in
``"The answer is \\boxed{<gold>}."`` instead of ``"#### <gold>"``, and the answer is read from the
last ``\\boxed{}``, else the last number of the completion.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ais_lightning.checks import check_int
from ais_lightning.tasks import answers
from ais_lightning.tasks.answers import normalize_answer
from ais_lightning.tasks.base import (
    ANSWER_INSTRUCTION,
    Task,
    TaskSample,
    check_aligned,
    check_format,
    map_characters,
)

__all__ = ["GSM8K", "check_gradable", "extract_answer", "gold_answer", "load_rows", "normalize_answer"]

_CALCULATOR_RE = re.compile(r"<<[^<>]*>>")
log = logging.getLogger(__name__)


def extract_answer(completion: str) -> str | None:
    """The final answer of a completion as the bare format reads it: last ``\\boxed{}``, else last
    ``<answer>``, else last ``####`` (:func:`ais_lightning.tasks.answers.extract_answer` with
    :attr:`GSM8K.BARE_READERS`)."""
    return answers.extract_answer(completion, GSM8K.BARE_READERS)


def gold_answer(answer: str) -> str:
    """The text after the last ``"####"`` of a GSM8K answer, stripped; ValueError if there is none."""
    if "####" not in answer:
        raise ValueError(f"GSM8K answer has no '####' final answer: {answer[-80:]!r}")
    return answer.rsplit("####", 1)[1].strip()


def check_gradable(rows: list[tuple[str, str]], path: str | Path, when: str = "") -> None:
    """ValueError naming ``path`` and the row unless every ``(question, answer)`` can be graded: its answer
    ends in ``#### <gold>`` with a gold answer that is not empty (an empty one pays an empty response), and no
    question comes twice with different gold answers (a completion cannot be right for both). ``when`` is
    said after the rows (``"once mapped"``)."""
    first_gold: dict[str, tuple[int, str]] = {}
    when = f" {when}" if when else ""
    for i, (question, answer) in enumerate(rows):
        if "####" not in answer:
            raise ValueError(
                f"gsm8k file {path} row {i}{when}: the answer has no '####' final answer: {answer[-80:]!r}"
            )
        gold = gold_answer(answer)
        if normalize_answer(gold) == "":  # nothing (or only "$", ",", "%") to compare with
            raise ValueError(
                f"gsm8k file {path} row {i}{when}: the gold answer after '####' is empty ({answer[-80:]!r}): an "
                "empty response would be graded right"
            )
        key = question.strip()
        if key in first_gold and normalize_answer(first_gold[key][1]) != normalize_answer(gold):
            j, other = first_gold[key]
            raise ValueError(
                f"gsm8k file {path} rows {j} and {i}{when} ask the same question {key[:80]!r} with different gold "
                f"answers ({other!r}, {gold!r}): a completion cannot be graded against both"
            )
        first_gold.setdefault(key, (i, gold))


MAX_LINE_BYTES = 1 << 20
"""Default bound on one line (one row) of a task file: 1 MiB, a thousand times a GSM8K row."""


def check_row_size(path: Path, where: str, size: int | None, max_line_bytes: int | None) -> None:
    """ValueError naming the file and ``where`` (``line 3``, ``row 3``) when a row of ``size`` bytes (None: a
    line not read to its end) is over ``max_line_bytes`` (None: no bound)."""
    if max_line_bytes is not None and (size is None or size > max_line_bytes):
        measured = "" if size is None else f" ({size} bytes)"
        raise ValueError(
            f"gsm8k file {path} {where} is longer than task.max_line_bytes={max_line_bytes} bytes{measured}; "
            "raise task.max_line_bytes (null: no bound) if the file is right"
        )


def _read_json_lines(path: Path, max_line_bytes: int | None) -> list[tuple[int, str]]:
    """``(line number, text)`` of every non-blank line, reading at most ``max_line_bytes + 1`` bytes of any
    line: a huge line is refused naming it before it is in memory."""
    lines = []
    limit = -1 if max_line_bytes is None else max_line_bytes + 1
    with open(path, "rb") as f:
        lineno = 0
        while True:
            raw = f.readline(limit)
            if not raw:
                break
            lineno += 1
            if max_line_bytes is not None and len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                check_row_size(path, f"line {lineno}", None, max_line_bytes)  # not read further
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"gsm8k file {path} is not UTF-8 text (line {lineno}: {err})") from None
            if text.strip():
                lines.append((lineno, text))
    return lines


def _read_json_rows(path: Path, max_line_bytes: int | None = MAX_LINE_BYTES) -> list[dict[str, Any]]:
    """Rows of a json-lines file (or one JSON array in a ``.json`` file), each a JSON object.

    ValueError naming the file (and the line for json lines) on invalid JSON, a row that is not an
    object, text that is not UTF-8, a line (or an array element) longer than ``max_line_bytes``, or a
    file with no rows.
    """
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if path.suffix == ".json" and head.startswith(b"["):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"gsm8k file {path} is not UTF-8 text ({err})") from None
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"gsm8k file {path} is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}"
            ) from None
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise ValueError(f"gsm8k file {path}: element {i} is not a JSON object: {str(row)[:80]!r}")
            check_row_size(path, f"element {i}", len(json.dumps(row).encode()), max_line_bytes)
        return rows
    lines = _read_json_lines(path, max_line_bytes)
    if not lines:
        raise ValueError(f"gsm8k file {path} is empty (expected json lines with 'question' and 'answer')")
    rows = []
    for lineno, line in lines:
        line = line.rstrip("\r\n")
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"gsm8k file {path} line {lineno} is not valid JSON ({err.msg} at column {err.colno}): "
                f"{line[:80]!r}"
            ) from None
        if not isinstance(row, dict):
            raise ValueError(f"gsm8k file {path} line {lineno} is not a JSON object: {line[:80]!r}")
        rows.append(row)
    return rows


def load_rows(
    path: str | Path,
    use_datasets: bool | None = None,
    cache_dir: str | None = None,
    max_line_bytes: int | None = MAX_LINE_BYTES,
) -> list[dict[str, Any]]:
    """Rows of a local ``.jsonl``/``.json`` or ``.parquet`` file.

    Through ``datasets.load_dataset("json"|"parquet", data_files=path)`` when ``use_datasets`` is
    True, or None and ``datasets`` is installed; otherwise json lines are read directly (parquet then
    needs ``pyarrow``). A local path only: nothing is downloaded. ``cache_dir`` is passed to
    ``load_dataset`` (None: the ``datasets`` default cache).

    Json files are always parsed here first, so an empty file, a line that is not valid JSON or a line
    longer than ``max_line_bytes`` (None: no bound) is a ValueError naming the file and the line, whichever
    backend reads the rows (a parquet row is measured once read); a failure inside ``datasets``/``pyarrow``
    is re-raised as a ValueError naming the file.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"gsm8k path {str(path)!r} is not a local file")
    kind = "parquet" if path.suffix == ".parquet" else "json"
    if kind == "parquet" and path.stat().st_size == 0:
        raise ValueError(
            f"gsm8k file {path} is empty (expected a parquet table with 'question' and 'answer')"
        )
    if kind == "parquet":
        _check_parquet_rows(path)
    rows = _read_json_rows(path, max_line_bytes) if kind == "json" else None
    if use_datasets is None:
        use_datasets = importlib.util.find_spec("datasets") is not None
    try:
        if use_datasets:
            import datasets

            return list(datasets.load_dataset(kind, data_files=str(path), split="train", cache_dir=cache_dir))
        if rows is not None:
            return rows
        if importlib.util.find_spec("pyarrow") is None:
            raise ValueError("reading parquet needs `datasets` or `pyarrow`; convert the file to jsonl")
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    except Exception as err:  # datasets / pyarrow errors (ArrowInvalid, DatasetGenerationError, ...)
        cache = _cache_write_error(err, path) if use_datasets else None
        if cache is not None:
            raise ValueError(
                f"gsm8k file {path}: the datasets library could not write its cache ({cache.filename}: "
                f"{cache.strerror}); set task.cache_dir to a writable directory, or task.use_datasets=false to "
                "read the file without datasets"
            ) from err
        raise ValueError(f"gsm8k file {path} could not be read: {type(err).__name__}: {err}") from err


def _check_parquet_rows(path: Path) -> None:
    """ValueError naming the file when a parquet table has no rows (``datasets`` reported a bare
    "DatasetGenerationError") or is not a parquet file; nothing when ``pyarrow`` is missing."""
    if importlib.util.find_spec("pyarrow") is None:
        return
    import pyarrow.parquet as pq

    try:
        rows = pq.ParquetFile(path).metadata.num_rows
    except Exception as err:  # ArrowInvalid and kin: not a parquet file
        raise ValueError(f"gsm8k file {path} could not be read: {type(err).__name__}: {err}") from err
    if rows == 0:
        raise ValueError(
            f"gsm8k file {path} is a parquet table with no rows (expected 'question' and 'answer')"
        )


def _cache_write_error(err: BaseException, path: Path) -> OSError | None:
    """The ``OSError`` behind ``err`` about a file other than the data file ``path`` (datasets' cache, under
    ``task.cache_dir`` or ``$HF_HOME``, e.g. a read-only home), else None."""
    from ais_lightning.files import find_cause

    def about_another_file(e: BaseException) -> bool:
        return isinstance(e, OSError) and e.filename is not None and Path(e.filename) != path

    return find_cause(err, about_another_file)  # type: ignore[return-value]


@dataclass
class GSM8K(Task):
    """Word problems from a local GSM8K-format file; reward 1 if the final answer matches the gold number."""

    name: ClassVar[str] = "gsm8k"
    """Its name in the registry (``TASKS``) and in messages."""

    path: str = ""
    """Local ``.jsonl``/``.json``/``.parquet`` file with ``question`` and ``answer`` fields."""
    prompt_template: str | None = None
    """Prompt built from the question (``str.format`` with ``question=``); None: the format's,
    ``"{question}\\n"`` (bare) or ``"{question}\\nPut the final answer in \\boxed{{}}."`` (chat)."""
    strip_calculator: bool = True
    """Remove GSM8K's ``<<a*b=c>>`` calculator annotations from the reference solution."""
    use_datasets: bool | None = None
    """Read through ``datasets`` (True), plain json lines (False) or ``datasets`` if installed (None)."""
    cache_dir: str | None = None
    """Cache directory for ``datasets`` (None: its default, ``~/.cache/huggingface/datasets``)."""
    max_line_bytes: int | None = MAX_LINE_BYTES
    """Longest line (json lines) or row (question + answer, parquet / JSON array) the file may hold, in bytes;
    a longer one is refused naming the file and the line before it is read whole. None: no bound."""
    format: str = "auto"
    """bare (the question, then GSM8K's worked answer ending in ``#### <gold>``), chat (the question asks for
    the answer in ``\\boxed{}``, the solution ends in it) or auto (chat when the policy prompts through its
    chat template, set by ``ais-train``; bare otherwise)."""
    extract: list[str] | None = None
    """Answer readers tried in order (``ais_lightning.tasks.answers.READERS``); None: ``[boxed, answer_tag,
    hashes]`` in the bare format, ``[boxed, last_number]`` in the chat format."""
    rows: list[dict[str, str]] = field(init=False, repr=False)
    """Loaded ``{"prompt", "solution", "answer"}`` rows, in the task's format."""

    BARE_READERS = ("boxed", "answer_tag", "hashes")
    BARE_TEMPLATE: ClassVar[str] = "{question}\n"
    """The bare format's prompt template."""
    CHAT_TEMPLATE: ClassVar[str] = "{question}\n" + ANSWER_INSTRUCTION.replace("{}", "{{}}")
    """The chat format's prompt template (``"{question}\\nPut the final answer in \\boxed{{}}."``)."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError(
                "gsm8k needs path= a local jsonl/parquet file with 'question' and 'answer' fields"
            )
        self.format, self.extract = check_format(self.format, self.extract)
        if self.prompt_template is not None:
            if not isinstance(self.prompt_template, str) or "{question}" not in self.prompt_template:
                raise ValueError(f"prompt_template must contain '{{question}}', got {self.prompt_template!r}")
            try:
                self.prompt_template.format(question="")
            except (IndexError, KeyError, ValueError) as err:
                raise ValueError(
                    f"prompt_template must be a str.format template whose only field is {{question}} (write "
                    f"literal braces as {{{{ }}}}), got {self.prompt_template!r}: {err!r}"
                ) from None
        if self.max_line_bytes is not None:
            check_int(self.max_line_bytes, "max_line_bytes")
        self._source = []
        rows = load_rows(self.path, self.use_datasets, self.cache_dir, self.max_line_bytes)
        for i, row in enumerate(rows):
            for key in ("question", "answer"):
                if not isinstance(row.get(key), str):
                    raise ValueError(f"{self.path} row {i} has no string field {key!r}")
            size = len(row["question"].encode()) + len(row["answer"].encode())
            check_row_size(Path(self.path), f"row {i}", size, self.max_line_bytes)  # parquet rows
            self._source.append((row["question"], row["answer"]))
        if not self._source:
            raise ValueError(
                f"gsm8k file {self.path} has no rows (expected rows with 'question' and 'answer' fields)"
            )
        check_gradable(self._source, self.path)
        self._mapped: set[int] = set()  # rows whose text fit_text mapped to the tokenizer's characters
        self._keep: Callable[[str], bool] | None = None
        self._build_rows()

    def _build_rows(self) -> None:
        """``rows`` (and the prompt -> gold lookup) in the task's current format, the rows :meth:`fit_text`
        mapped in the tokenizer's characters."""
        template = self.prompt_template or (self.CHAT_TEMPLATE if self.chat_format else self.BARE_TEMPLATE)
        self.rows = []
        for i, (question, answer) in enumerate(self._source):
            solution = _CALCULATOR_RE.sub("", answer) if self.strip_calculator else answer
            if self.chat_format:  # the worked reasoning, then the gold answer in a box instead of "#### gold"
                reasoning = solution.rsplit("####", 1)[0].strip()
                solution = f"{reasoning}\nThe answer is \\boxed{{{gold_answer(answer)}}}."
            row = {
                "prompt": template.format(question=question.strip()),
                "solution": solution.strip(),
                "answer": gold_answer(answer),
            }
            if i in self._mapped and self._keep is not None:
                row = {key: map_characters(text, self._keep) for key, text in row.items()}
            self.rows.append(row)
        self._gold_by_prompt = {row["prompt"]: row["answer"] for row in self.rows}

    def fit_text(self, keep: Callable[[str], bool]) -> None:
        """Map the rows holding characters the policy's tokenizer cannot encode (``keep(ch)`` False) with
        :func:`~ais_lightning.tasks.base.map_characters`, warning with the count and an example; ValueError
        naming the file and rows when the mapping leaves a question without a letter or digit, or makes two
        questions with different gold answers one. A file the tokenizer encodes whole is kept as written."""
        foreign = sorted({ch for pair in self._source for text in pair for ch in text if not keep(ch)})
        if not foreign:
            return
        self._mapped = {
            i for i, pair in enumerate(self._source) if any(ch in foreign for t in pair for ch in t)
        }
        self._keep = keep
        self._build_rows()
        mapped = [(i, self.rows[i]["prompt"]) for i in sorted(self._mapped)]
        emptied = [i for i, prompt in mapped if not any(ch.isalnum() for ch in prompt)]
        if emptied:
            question = self._source[emptied[0]][0]
            raise ValueError(
                f"gsm8k file {self.path}: {len(emptied)} question(s) keep no letter or digit once mapped to the "
                f"characters the policy's tokenizer encodes (rows {emptied[:5]}; row {emptied[0]}: {question!r} -> "
                f"{self.rows[emptied[0]]['prompt']!r}): use a policy whose tokenizer encodes their text"
            )
        check_gradable(
            [(row["prompt"], f"#### {row['answer']}") for row in self.rows], self.path, "once mapped"
        )
        first = mapped[0][0]
        log.warning(
            "gsm8k file %s: %d of %d rows hold characters the policy's tokenizer cannot encode (%s); their text "
            "is mapped to characters it encodes (accents dropped, typographic signs in ASCII, the rest "
            "removed), e.g. row %d: %r -> %r",
            self.path,
            len(mapped),
            len(self._source),
            "".join(foreign[:20]) + ("..." if len(foreign) > 20 else ""),
            first,
            self._source[first][0][:80],
            self.rows[first]["prompt"][:80],
        )

    def resolve_format(self, chat_template: bool) -> str:
        """As :meth:`Task.resolve_format`; the rows are rebuilt in the format settled on."""
        before = self.format
        after = super().resolve_format(chat_template)
        if after != before:
            self._build_rows()
        return after

    def sample(self, rng: random.Random) -> TaskSample:
        row = self.rows[rng.randrange(len(self.rows))]
        return TaskSample(prompt=row["prompt"], solution=row["solution"], fields={"answer": row["answer"]})

    def reward(
        self, prompts: list[str], completions: list[str], answer: list[str] | None = None, **fields: Any
    ) -> list[float]:
        """1.0 if the completion's final answer equals the gold answer, else 0.0 (always 0.0 for an empty gold
        answer: nothing to be right about).

        ``answer`` defaults to looking each prompt up in the loaded file (ValueError if absent).
        """
        check_aligned(prompts, completions, answer=answer)
        rewards = []
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            if answer is not None:
                gold = answer[i]
            elif prompt in self._gold_by_prompt:
                gold = self._gold_by_prompt[prompt]
            else:
                raise ValueError(f"prompt {prompt[:60]!r} is not in {self.path}; pass answer=")
            predicted = self.read_answer(completion)
            expected = normalize_answer(str(gold))
            match = predicted is not None and expected != "" and normalize_answer(predicted) == expected
            rewards.append(1.0 if match else 0.0)
        return rewards
