"""Bare and chat formats of every task: hand-written prompts and solutions, how answers are read, and
``format=auto`` following the policy's chat template."""

import dataclasses
import random
from pathlib import Path

import pytest

from ais_lightning.tasks import get_task
from ais_lightning.tasks.datamodule import draw_sample

SAMPLE = Path(__file__).with_name("gsm8k_sample.jsonl")
INSTRUCTION = "Put the final answer in \\boxed{}."


def first(name, **options):
    return get_task(name, **options).sample(random.Random(0))


def test_arithmetic_chat_prompt_and_solution():
    bare = first("arithmetic")
    assert (bare.prompt, bare.solution, bare.fields) == ("63+75=", "138", {"answer": 138})  # unchanged
    chat = first("arithmetic", format="chat")
    assert chat.prompt == "What is 63+75? " + INSTRUCTION
    assert chat.solution == "63 + 75 = 138. The answer is \\boxed{138}."
    assert chat.fields == {"answer": 138}
    negative = first("arithmetic", format="chat", operators="-")
    assert negative.prompt == "What is 63-75? " + INSTRUCTION
    assert negative.solution == "63 - 75 = -12. The answer is \\boxed{-12}."


def test_arithmetic_chat_reward_reads_boxes_and_numbers():
    task = get_task("arithmetic", format="chat")
    completions = [
        "63 + 75 = 138. The answer is \\boxed{138}.",
        "63+75 = 138",  # no box: the last number
        "The sum is $138.00.",
        "\\boxed{138} hmm, or 139?",  # the box wins
        "\\boxed{137}",
        "63 + 75 = 139",
        "I cannot compute that.",  # no answer at all
        "",
    ]
    n = len(completions)
    expected = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    prompt = "What is 63+75? " + INSTRUCTION
    assert task.reward([prompt] * n, completions, answer=[138] * n) == expected
    assert task.reward([prompt] * n, completions) == expected  # the answer re-evaluated from the chat prompt
    negative = "What is 63-75? " + INSTRUCTION
    assert task.reward([negative] * 3, ["= -12", "\\boxed{-12}", "63 - 75 = 12"]) == [1.0, 1.0, 0.0]


def test_the_bare_format_reads_only_the_first_line_exactly():
    bare = get_task("arithmetic")  # format auto, used on its own: bare
    assert bare.format == "auto" and not bare.chat_format and bare.readers == ("first_line",)
    completions = ["138", "\\boxed{138}", "63+75 = 138", "138.0"]
    assert bare.reward(["63+75="] * 4, completions) == [1.0, 0.0, 0.0, 0.0]
    explicit = get_task("arithmetic", format="bare")
    assert [explicit.sample(random.Random(i)) for i in range(5)] == [
        bare.sample(random.Random(i)) for i in range(5)
    ]


def test_extract_overrides_the_formats_readers():
    boxed_only = get_task("arithmetic", format="chat", extract=["boxed"])
    assert boxed_only.readers == ("boxed",)
    prompt = "What is 63+75? " + INSTRUCTION
    assert boxed_only.reward([prompt] * 2, ["\\boxed{138}", "63 + 75 = 138"]) == [1.0, 0.0]
    number_first_line = get_task("arithmetic", format="bare", extract=["last_number"])
    assert number_first_line.reward(["63+75="], ["so 63+75 = 138"]) == [1.0]


def test_countdown_chat_prompt_solution_and_reading():
    bare = first("countdown")
    assert (bare.prompt, bare.solution) == ("7 7 1>14:", "<answer>7+7</answer>")  # unchanged
    chat = first("countdown", format="chat")
    assert chat.prompt == (
        "Using the numbers 7, 7 and 1, write an arithmetic expression that equals 14. You may use "
        "+ - * / and parentheses, each number at most once. Put the final expression in \\boxed{}."
    )
    assert chat.solution == "7+7 = 14. The answer is \\boxed{7+7}."
    assert chat.fields == {"numbers": [7, 7, 1], "target": 14}
    task = get_task("countdown", format="chat")
    completions = [
        chat.solution,
        "\\boxed{(7 \\times 1) + 7}",  # LaTeX times
        "\\boxed{14 = 7 + 7}",  # the side with the operators
        "<answer>7*1+7</answer>",  # TinyZero's tags
        "We can do 7 + 7 = 14.",  # no box, no tags: the last expression in the text
        "\\boxed{14}",  # the target, not an expression: well formed, wrong
        "7 + 7 = 14, so 14 * 1 = 14",  # the last expression uses 14, which is not given
        "I give up.",
    ]
    n = len(completions)
    expected = [1.0, 1.0, 1.0, 1.0, 1.0, 0.1, 0.1, 0.0]
    assert task.reward([chat.prompt] * n, completions, numbers=[[7, 7, 1]] * n, target=[14] * n) == expected
    assert (
        task.reward([chat.prompt] * n, completions) == expected
    )  # numbers and target parsed from the prompt
    # the bare format parses the tags as written: LaTeX or a box is not read
    assert get_task("countdown").reward(
        ["7 7 1>14:"] * 2, ["\\boxed{7+7}", "<answer>7\\times 2</answer>"]
    ) == [
        0.0,
        0.0,
    ]


def test_sudoku4_chat_prompt_solution_and_reading():
    bare = first("sudoku4", empty_cells=6)
    assert (bare.prompt, bare.solution) == (".2...34.24133.24:", "4231134224133124")  # unchanged
    chat = first("sudoku4", empty_cells=6, format="chat")
    assert chat.prompt == (
        "Solve this 4x4 sudoku: fill each . with a digit from 1 to 4 so that every row, column and 2x2 box "
        "holds each digit once.\n.2..\n.34.\n2413\n3.24\n"
        "Put the final answer, the 16 digits of the solved grid row by row, in \\boxed{}."
    )
    assert chat.solution == "4231\n1342\n2413\n3124\nThe answer is \\boxed{4231134224133124}."
    task = get_task("sudoku4", format="chat")
    wrong_two = "4213 1342 2413 3124"  # empty cells 2 and 3 swapped (column 3 repeats 1): 4 of 6 right
    completions = [
        chat.solution,
        "\\boxed{4231 1342 2413 3124}",  # separators inside the box
        "The grid is\n4 2 3 1\n1 3 4 2\n2 4 1 3\n3 1 2 4",  # no box: the last 16 digits 1-4
        f"\\boxed{{{wrong_two}}}",
        "\\boxed{423113422413312}",  # 15 digits
        "no idea",
    ]
    n = len(completions)
    expected = [1.0, 1.0, 1.0, 4 / 6, 0.0, 0.0]
    assert task.reward([chat.prompt] * n, completions, answer=[chat.fields["answer"]] * n) == expected
    assert task.reward([chat.prompt] * n, completions) == expected  # the puzzle parsed from the chat prompt


def test_gsm8k_chat_rows_and_reading():
    bare = get_task("gsm8k", path=str(SAMPLE), use_datasets=False)
    assert bare.rows[3] == {  # unchanged
        "prompt": "A city has 1,200 cars and adds 300. How many cars are there now?\n",
        "solution": "1200+300=1500 cars.\n#### 1,500",
        "answer": "1,500",
    }
    chat = get_task("gsm8k", path=str(SAMPLE), use_datasets=False, format="chat")
    assert chat.rows[3] == {
        "prompt": "A city has 1,200 cars and adds 300. How many cars are there now?\n" + INSTRUCTION,
        "solution": "1200+300=1500 cars.\nThe answer is \\boxed{1,500}.",
        "answer": "1,500",
    }
    prompt = chat.rows[3]["prompt"]
    completions = ["There are 1,500 cars.", "\\boxed{1500}", "#### 1500\nso 1500 cars, not 1400", "no"]
    assert chat.reward([prompt] * 4, completions) == [1.0, 1.0, 0.0, 0.0]  # last number: 1400
    own = get_task(
        "gsm8k", path=str(SAMPLE), use_datasets=False, format="chat", prompt_template="Q: {question}"
    )
    assert own.rows[0]["prompt"] == "Q: Tom has 3 apples and buys 4 more. How many apples does he have?"
    with pytest.raises(ValueError, match="prompt_template must be a str.format template"):
        get_task("gsm8k", path=str(SAMPLE), use_datasets=False, prompt_template="{question} \\boxed{}")


@pytest.mark.parametrize("name", ["arithmetic", "countdown", "sudoku4", "gsm8k"])
def test_resolve_format_follows_the_chat_template_and_keeps_an_explicit_value(name):
    options = {"path": str(SAMPLE), "use_datasets": False} if name == "gsm8k" else {}
    auto = get_task(name, **options)
    assert auto.format == "auto"
    bare = draw_sample(auto, 0, "val", 0)
    assert auto.resolve_format(chat_template=True) == "chat" and auto.chat_format
    chat = draw_sample(auto, 0, "val", 0)
    assert chat.prompt != bare.prompt and "\\boxed{}" in chat.prompt and "\\boxed{" in chat.solution
    assert chat.fields == bare.fields  # the same problem, asked in words
    assert auto.reward([chat.prompt], [chat.solution], **{k: [v] for k, v in chat.fields.items()}) == [1.0]
    for fmt in ("bare", "chat"):
        explicit = get_task(name, format=fmt, **options)
        assert explicit.resolve_format(chat_template=fmt == "bare") == fmt  # kept either way
    assert get_task(name, **options).resolve_format(chat_template=False) == "bare"


@pytest.mark.parametrize("name", ["arithmetic", "countdown", "sudoku4", "gsm8k"])
def test_bad_format_options_name_the_field(name):
    options = {"path": str(SAMPLE), "use_datasets": False} if name == "gsm8k" else {}
    with pytest.raises(ValueError, match=r"format must be one of \['auto', 'bare', 'chat'\], got 'Chat'"):
        get_task(name, format="Chat", **options)
    with pytest.raises(ValueError, match=r"extract has unknown reader\(s\) \['box'\]"):
        get_task(name, extract=["box"], **options)


def test_the_format_is_in_the_warm_start_fingerprint():
    from ais_lightning.app.warmstart import task_fingerprint

    auto, chat = get_task("arithmetic"), get_task("arithmetic")
    chat.resolve_format(chat_template=True)
    auto.resolve_format(chat_template=False)
    assert task_fingerprint(auto)["fields"]["format"] == "bare"
    assert task_fingerprint(chat)["fields"]["format"] == "chat"
    assert task_fingerprint(auto) == task_fingerprint(get_task("arithmetic", format="bare"))
    reading = dataclasses.replace(chat, extract=["boxed"])
    assert task_fingerprint(reading) != task_fingerprint(chat)
