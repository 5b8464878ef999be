"""Task base class, the task registry, safe reward evaluation and shared parsing helpers.

A task turns a ``random.Random`` into a :class:`TaskSample` (prompt, reference solution, fields)
and scores completions with a reward function that has TRL's signature,
``reward(prompts, completions, **fields) -> list[float]``, where every field is a list aligned
with ``prompts``.

Adding a task
-------------
Write one small module with a dataclass subclass of :class:`Task` whose ``name`` is its config name::

    from dataclasses import dataclass
    import random
    from typing import ClassVar

    from ais_lightning.tasks import Task, TaskSample, first_line


    @dataclass
    class Reverse(Task):
        name: ClassVar[str] = "reverse"
        length: int = 5
        '''Characters per word.'''

        def sample(self, rng: random.Random) -> TaskSample:
            word = "".join(rng.choice("abcdef") for _ in range(self.length))
            return TaskSample(prompt=word + ">", solution=word[::-1], fields={"answer": word[::-1]})

        def reward(self, prompts, completions, answer=None, **fields):
            return [float(first_line(c) == a) for c, a in zip(completions, answer)]

then register it in the package's ``TASKS`` (``ais_lightning/tasks/__init__.py``; ``get_task("reverse", length=3)``
builds it) and give it a YAML option (docs/design.md, "Adding a task"). The built-in tokenizer is
character-level over printable ASCII (32..126) and ``"\\n"``: a task that writes its own text keeps to those;
one that reads text from files keeps it as written and maps only what the policy's tokenizer cannot encode,
saying so (:meth:`Task.fit_text`, :func:`map_characters`).
"""

from __future__ import annotations

import abc
import ast
import functools
import logging
import math
import random
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, ClassVar

from ais_lightning.tasks.answers import check_readers, extract_answer, first_line

__all__ = [
    "ALLOWED_CHARS",
    "ANSWER_INSTRUCTION",
    "MAX_ABS_REWARD",
    "FORMATS",
    "Task",
    "TaskSample",
    "batch_rewards",
    "check_aligned",
    "check_format",
    "evaluate_expression",
    "expression_numbers",
    "first_line",
    "map_characters",
    "parse_expression",
    "parse_int",
    "safe_rewards",
    "to_ascii",
    "tokenizer_keeps",
]

log = logging.getLogger(__name__)

ALLOWED_CHARS = frozenset(chr(c) for c in range(32, 127)) | {"\n"}
"""Characters the built-in character-level tokenizer knows: printable ASCII 32..126 and newline."""


@dataclass
class TaskSample:
    """One problem of a task."""

    prompt: str
    """What the policy is conditioned on."""
    solution: str
    """A reference completion (the SFT warm-start trains on it); RL scores completions with the reward."""
    fields: dict[str, Any] = field(default_factory=dict)
    """Extra per-sample data the reward needs, e.g. ``{"answer": 46}``; becomes batch columns."""


FORMATS = ("auto", "bare", "chat")
"""Prompt formats of the built-in tasks (their ``format`` option): ``bare`` is the terse text the built-in
character-level model learns (``"12+34="`` -> ``"46"``), ``chat`` asks in words an instruction-tuned model
follows and reads its answer from prose (``"What is 12+34? Put the final answer in \\boxed{}."``), ``auto``
is ``chat`` when the policy prompts through its chat template (``policy.chat_template``), else ``bare``
(``ais-train`` settles it when it builds the run; a task used on its own reads ``auto`` as ``bare``)."""

ANSWER_INSTRUCTION = "Put the final answer in \\boxed{}."
"""The sentence chat-format prompts end with (the reference solutions end in ``\\boxed{<answer>}``)."""


def check_format(format: str, extract: Sequence[str] | None) -> tuple[str, list[str] | None]:
    """A task's ``format`` and ``extract`` options, checked (ValueError naming the option); ``extract`` as
    a plain list (a config's ListConfig too)."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {list(FORMATS)}, got {format!r}")
    readers = check_readers(extract, "extract")
    return format, None if readers is None else list(readers)


class Task(abc.ABC):
    """A prompt generator with a reward function (subclasses are dataclasses of their options).

    The built-in tasks also have a ``format`` option (:data:`FORMATS`) and an ``extract`` option (the
    :data:`ais_lightning.tasks.answers.READERS` that find the answer in a completion, tried in order;
    None: the format's own, ``BARE_READERS`` or ``CHAT_READERS`` of the class).
    """

    name: ClassVar[str] = ""
    """Its config name: the key of the class in ``ais_lightning.tasks.TASKS`` ("" for a task outside it)."""
    format: str = "bare"
    """Prompt format (a task without the option prompts in its one, bare format)."""
    extract: list[str] | None = None
    """Answer readers (None: the format's)."""
    BARE_READERS: ClassVar[tuple[str, ...]] = ("first_line",)
    """Readers of the bare format when ``extract`` is None."""
    CHAT_READERS: ClassVar[tuple[str, ...]] = ("boxed", "last_number")
    """Readers of the chat format when ``extract`` is None."""

    def resolve_format(self, chat_template: bool) -> str:
        """Settle ``format="auto"``: ``"chat"`` when prompts go through the policy's chat template, else
        ``"bare"``; an explicit ``bare`` or ``chat`` is kept. Returns the format now in effect."""
        if self.format == "auto":
            self.format = "chat" if chat_template else "bare"
        return self.format

    def response_budget(self, problems: int = 256) -> int:
        """A response length (in tokens) that holds this task's answers in its format: the longest reference
        solution of ``problems`` problems (seed 0) in UTF-8 bytes (characters, for ASCII text), plus the end of
        sequence, rounded up to a power of two, at least 8. Bytes bound the tokens of any tokenizer (a token
        holds at least one character, and a byte-level one at least one byte), and the rounding leaves a model
        that phrases the answer in its own words up to twice the reference's length. ``algorithm.max_new_tokens`` left unset (null) is this budget, for the
        format in effect. Override it for a task whose answers are not like its reference solutions."""
        rng = random.Random(0)
        longest = max(len(self.sample(rng).solution.encode("utf-8")) for _ in range(problems))
        return max(8, 1 << longest.bit_length())  # the power of two above longest, which leaves room for EOS

    @property
    def chat_format(self) -> bool:
        """Prompts and solutions are in the chat format (``format="chat"``; ``auto`` unresolved is bare)."""
        return self.format == "chat"

    @property
    def readers(self) -> tuple[str, ...]:
        """The answer readers in effect: ``extract``, else the format's own."""
        if self.extract:
            return tuple(self.extract)
        return self.CHAT_READERS if self.chat_format else self.BARE_READERS

    def fit_text(self, keep: Callable[[str], bool]) -> None:
        """Make the task's text fit the policy's tokenizer, ``keep(ch)`` telling whether it encodes the character
        ``ch`` as it is (``ais-train`` calls this once the policy is built). Tasks that write their own ASCII
        text need nothing (this default); a task reading text from a file maps what the tokenizer cannot encode
        and says how much it changed, or refuses rows that cannot be graded any more (``GSM8K``)."""
        return None

    def read_answer(self, completion: str) -> str | None:
        """The answer text of a completion through :attr:`readers` (None if none of them finds one)."""
        return extract_answer(completion, self.readers)

    @abc.abstractmethod
    def sample(self, rng: random.Random) -> TaskSample:
        """Draw one problem; deterministic given the state of ``rng``."""

    @abc.abstractmethod
    def reward(self, prompts: list[str], completions: list[str], **fields: Any) -> list[float]:
        """Score ``completions`` (fields are lists aligned with ``prompts``, TRL's reward signature)."""

    def __call__(self, prompts: list[str], completions: list[str], **fields: Any) -> list[float]:
        return self.reward(prompts, completions, **fields)


MAX_ABS_REWARD = 1e18
"""The largest reward magnitude a run takes: rewards are float32 and GRPO's group variance squares them, which
overflows past sqrt(3.4e38) ~ 1.8e19 (a reward of 1e308 made every advantage non-finite)."""


def safe_rewards(
    reward_fn: Callable[..., Sequence[Any]],
    prompts: Sequence[str],
    completions: Sequence[str],
    fields: Mapping[str, Sequence[Any]] | None = None,
) -> tuple[list[float], int]:
    """Call ``reward_fn(prompts, completions, **fields)`` without letting it crash training.

    Returns ``(rewards, n_failed)``. If the function raises (``sys.exit`` included) or returns something
    that is not a sequence of length ``len(prompts)``, every reward is 0 and ``n_failed == len(prompts)``;
    an entry that is not a finite number (None, NaN, inf, a string) or is beyond :data:`MAX_ABS_REWARD`
    becomes 0 and is counted, with a warning saying which.
    Mismatched *inputs* (``completions`` or a field not aligned with ``prompts``) are the
    caller's bug and raise ValueError.
    """
    n = len(prompts)
    fields = dict(fields or {})
    if len(completions) != n:
        raise ValueError(f"completions has {len(completions)} entries, expected {n} (one per prompt)")
    for key, values in fields.items():
        if len(values) != n:
            raise ValueError(f"field {key!r} has {len(values)} entries, expected {n} (one per prompt)")
    name = getattr(reward_fn, "__name__", type(reward_fn).__name__)
    try:
        result = reward_fn(list(prompts), list(completions), **{k: list(v) for k, v in fields.items()})
        values = list(result)
    except (Exception, SystemExit) as err:  # any failure of user code is scored 0, a sys.exit() in it too
        what = (
            f"SystemExit({err.code!r}) (sys.exit called in the reward)" if isinstance(err, SystemExit) else ""
        )
        log.warning(
            "reward function %s raised %s: %s; scoring %d samples 0",
            name,
            what or type(err).__name__,
            err,
            n,
        )
        return [0.0] * n, n
    if len(values) != n:
        log.warning(
            "reward function %s returned %d values for %d samples; scoring all 0", name, len(values), n
        )
        return [0.0] * n, n
    rewards: list[float] = []
    huge: list[float] = []
    n_failed = 0
    for value in values:
        try:
            reward = float(value)
        except (TypeError, ValueError):
            reward = math.nan
        if math.isfinite(reward) and abs(reward) > MAX_ABS_REWARD:
            huge.append(reward)
            reward = math.nan
        if not math.isfinite(reward):
            reward, n_failed = 0.0, n_failed + 1
        rewards.append(reward)
    if huge:
        log.warning(
            "reward function %s gave %d values beyond +-%g (e.g. %g): the group's reward variance would overflow "
            "float32 (its largest value is 3.4e38); scored 0",
            name,
            len(huge),
            MAX_ABS_REWARD,
            huge[0],
        )
    if n_failed > len(huge):
        log.warning(
            "reward function %s gave %d non-finite or non-numeric values; scored 0",
            name,
            n_failed - len(huge),
        )
    return rewards, n_failed


# ----------------------------------------------------------------------------------------- text helpers


SOLVED_REWARD = 1.0 - 1e-6
"""A reward at least this solves its problem (the built-in tasks give 1.0 for a right answer): what accuracy counts."""


def accuracy(rewards: Sequence[float]) -> float:
    """The share of ``rewards`` that solve their problem (>= :data:`SOLVED_REWARD`); 0.0 for none.

    >>> accuracy([1.0, 0.0, 0.5, 1.0])
    0.5
    """
    rewards = list(rewards)
    return sum(r >= SOLVED_REWARD for r in rewards) / len(rewards) if rewards else 0.0


def batch_rewards(
    task: Task, samples: Sequence[TaskSample], batch: Any, tokenizer: Any
) -> tuple[list[float], int]:
    """Rewards of every row of a ``RolloutBatch`` through :func:`safe_rewards`: ``(rewards, n_failed)``.

    Row ``i`` answers ``samples[batch.prompt_index[i]]``; its completion is the decoded valid response
    tokens (``response_ids[response_mask]``, special tokens skipped); the samples' fields go along.
    """
    completions = [
        tokenizer.decode(ids[mask].tolist(), skip_special_tokens=True)
        for ids, mask in zip(batch.response_ids, batch.response_mask)
    ]
    rows = batch.prompt_index.tolist()
    fields = {k: [samples[i].fields[k] for i in rows] for k in samples[0].fields}
    return safe_rewards(task.reward, [samples[i].prompt for i in rows], completions, fields)


_ASCII_FORMS = {
    "\u2018": "'",
    "\u2019": "'",
    "\u201c": '"',
    "\u201d": '"',
    "\u2013": "-",
    "\u2014": "-",
    "\u2212": "-",
    "\u00d7": "*",
    "\u00f7": "/",
    "\u2044": "/",
    "\t": " ",
    "\r": "\n",
    "\u00a0": " ",
    "\u2026": "...",
}
"""ASCII forms of typographic quotes and dashes, math signs, the fraction slash, tab, CR, no-break space, ellipsis."""


def _map_character(ch: str, keep: Callable[[str], bool]) -> str:
    if keep(ch):
        return ch
    if ch in _ASCII_FORMS:
        return "".join(c for c in _ASCII_FORMS[ch] if keep(c))
    parts = unicodedata.normalize("NFKD", ch)  # NFKD is idempotent: its parts decompose no further
    return "" if parts == ch else "".join(_map_character(p, keep) for p in parts)


def map_characters(text: str, keep: Callable[[str], bool]) -> str:
    """``text`` with every character that ``keep`` refuses replaced: by its ASCII form (typographic quotes and
    dashes, ``×`` ``÷`` ``−``, tab, CR, no-break space, ellipsis), else by the parts of its NFKD decomposition
    that ``keep`` accepts (``é`` -> ``e``, ``½`` -> ``1/2``), else dropped. Characters ``keep`` accepts are
    never changed; ``"\r\n"`` becomes ``"\n"`` when ``keep`` refuses ``"\r"``."""
    if not keep("\r"):
        text = text.replace("\r\n", "\n")
    return "".join(_map_character(ch, keep) for ch in text)


def tokenizer_keeps(tokenizer: Any) -> Callable[[str], bool]:
    """``keep(ch)`` for :meth:`Task.fit_text`: whether ``tokenizer`` (a Hugging Face tokenizer) encodes the
    character ``ch`` so that decoding gives it back, tried between two letters (some tokenizers drop a lone
    space); remembered per character."""

    @functools.cache
    def keep(ch: str) -> bool:
        text = f"a{ch}a"
        ids = tokenizer.encode(text, add_special_tokens=False)
        return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) == text

    return keep


def to_ascii(text: str) -> str:
    """Map free text onto the built-in tokenizer's alphabet (printable ASCII and newline):
    :func:`map_characters` keeping :data:`ALLOWED_CHARS` (``"é"`` -> ``"e"``, ``"½"`` -> ``"1/2"``)."""
    return map_characters(text, ALLOWED_CHARS.__contains__)


def check_aligned(prompts: Sequence[str], completions: Sequence[str], **fields: Sequence[Any] | None) -> None:
    """Raise ValueError unless completions and every non-None field have one entry per prompt."""
    if len(completions) != len(prompts):
        raise ValueError(
            f"completions has {len(completions)} entries, expected {len(prompts)} (one per prompt)"
        )
    for key, values in fields.items():
        if values is not None and len(values) != len(prompts):
            raise ValueError(
                f"field {key!r} has {len(values)} entries, expected {len(prompts)} (one per prompt)"
            )


# ------------------------------------------------------------------------ safe arithmetic expressions

MAX_EXPRESSION_CHARS = 200
"""Longer expressions are rejected before parsing (bounds parse depth and integer sizes)."""

_EXPRESSION_CHARS = frozenset("0123456789+-*/() ")
_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


def parse_expression(text: str) -> ast.expr:
    """Parse ``text`` as an arithmetic expression of non-negative integers, ``+ - * /`` and parentheses.

    Nothing is evaluated here: the string is checked against a character whitelist, parsed with
    :func:`ast.parse` in ``eval`` mode, and every node must be a binary operation of those four
    operators or a non-negative integer literal (no names, calls, unary minus, floats or powers).
    Raises ValueError otherwise.
    """
    if not isinstance(text, str):
        raise ValueError(f"expression must be a str, got {type(text).__name__}")
    if not text.strip():
        raise ValueError("expression is empty")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression has {len(text)} characters, at most {MAX_EXPRESSION_CHARS} allowed")
    bad = set(text) - _EXPRESSION_CHARS
    if bad:
        raise ValueError(f"expression contains disallowed characters {''.join(sorted(bad))!r}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, RecursionError, MemoryError) as err:
        raise ValueError(f"expression {text!r} does not parse: {err}") from None
    for node in ast.walk(tree.body):
        if isinstance(node, ast.BinOp):
            if type(node.op) not in _BINOPS:
                raise ValueError(f"operator {type(node.op).__name__} is not allowed (only + - * /)")
        elif isinstance(node, ast.Constant):
            if type(node.value) is not int:
                raise ValueError(f"only integer literals are allowed, got {node.value!r}")
        elif not isinstance(node, ast.operator):
            raise ValueError(f"{type(node).__name__} is not allowed in an arithmetic expression")
    return tree.body


def expression_numbers(tree: ast.expr) -> list[int]:
    """The integer literals of a parsed expression, left to right."""
    if isinstance(tree, ast.BinOp):
        return expression_numbers(tree.left) + expression_numbers(tree.right)
    return [tree.value]  # type: ignore[attr-defined]


def evaluate_expression(tree: ast.expr) -> Fraction:
    """Exact value of a tree from :func:`parse_expression`; ZeroDivisionError on division by zero."""
    if isinstance(tree, ast.BinOp):
        left, right = evaluate_expression(tree.left), evaluate_expression(tree.right)
        op = _BINOPS[type(tree.op)]
        if op == "+":
            return left + right
        if op == "-":
            return left - right
        if op == "*":
            return left * right
        return left / right
    return Fraction(tree.value)  # type: ignore[attr-defined]


def parse_int(text: str) -> int | None:
    """``text`` as an integer (optional sign, digits only), else None."""
    text = text.strip()
    body = text[1:] if text[:1] in "+-" else text
    if not body.isascii() or not body.isdigit() or len(body) > 100:
        return None
    return int(text)
