import pytest

from ais_lightning.tasks import PromptDataModule, PromptStream, TaskSample, collate_samples, get_task


def prompts_of(batches):
    return [p for b in batches for p in b["prompt"]]


def make_dm(**kwargs):
    defaults = dict(task=get_task("arithmetic"), train_size=20, val_size=6, batch_size=4, seed=0)
    dm = PromptDataModule(**(defaults | kwargs))
    dm.setup("fit")
    return dm


def test_collate_keeps_lists():
    samples = [TaskSample("1+2=", "3", {"answer": 3}), TaskSample("2+2=", "4", {"answer": 4})]
    assert collate_samples(samples) == {"prompt": ["1+2=", "2+2="], "solution": ["3", "4"], "answer": [3, 4]}
    with pytest.raises(ValueError, match="different fields"):
        collate_samples([samples[0], TaskSample("x", "y", {"other": 1})])


def test_batches_have_task_fields():
    batch = next(iter(make_dm(task=get_task("countdown")).train_dataloader()))
    assert set(batch) == {"prompt", "solution", "numbers", "target"} and len(batch["prompt"]) == 4
    assert all(isinstance(x, list) for x in batch.values())


def test_deterministic_from_seed():
    a, b, c = make_dm(seed=7), make_dm(seed=7), make_dm(seed=8)
    assert list(a.train_dataloader()) == list(b.train_dataloader())
    assert list(a.val_dataloader()) == list(b.val_dataloader())
    assert prompts_of(a.train_dataloader()) != prompts_of(c.train_dataloader())
    assert prompts_of(a.val_dataloader()) != prompts_of(c.val_dataloader())


def test_train_and_val_are_disjoint():
    # 1-digit addition has only 100 distinct prompts: independent streams would collide
    task = get_task("arithmetic", digits=1)
    overlapping = make_dm(task=task, train_size=200, val_size=30, disjoint=False)
    val = set(prompts_of(overlapping.val_dataloader()))
    assert len(val) > 20 and val & set(prompts_of(overlapping.train_dataloader()))
    dm = make_dm(task=task, train_size=200, val_size=30)
    assert prompts_of(dm.val_dataloader()) == prompts_of(overlapping.val_dataloader())  # val stream unchanged
    assert not set(prompts_of(dm.val_dataloader())) & set(prompts_of(dm.train_dataloader()))


def test_finite_epochs_reshuffle_the_same_pool():
    loader = make_dm(train_size=10, batch_size=4).train_dataloader()
    assert len(loader) == 3  # ceil(10 / 4)
    first, second = list(loader), list(loader)
    assert [len(b["prompt"]) for b in first] == [4, 4, 2]
    assert sorted(prompts_of(first)) == sorted(prompts_of(second)) and prompts_of(first) != prompts_of(second)
    assert len(make_dm(train_size=10, batch_size=4, drop_last=True).train_dataloader()) == 2


def test_infinite_mode_keeps_drawing_fresh_samples():
    loader = make_dm(
        train_size=None, batches_per_epoch=3, task=get_task("arithmetic", digits=4)
    ).train_dataloader()
    assert len(loader) == 3
    prompts = prompts_of(list(loader) + list(loader))
    assert len(prompts) == 24 and len(set(prompts)) == 24  # 24 draws of 4-digit sums: no repeats expected


@pytest.mark.parametrize("train_size", [10, None])
def test_state_dict_round_trip_restores_position(train_size):
    reference = make_dm(train_size=train_size, batches_per_epoch=3).train_dataloader()
    expected = list(reference) + list(reference)  # two epochs of 3 batches

    loader = make_dm(train_size=train_size, batches_per_epoch=3).train_dataloader()
    it = iter(loader)
    consumed = [next(it), next(it)]
    state = loader.state_dict()
    assert (state["epoch"], state["batch"]) == (0, 2)

    resumed = make_dm(train_size=train_size, batches_per_epoch=3).train_dataloader()
    iter(resumed)  # an iterator that is created but never advanced (Lightning's iterable check) is harmless
    resumed.load_state_dict(state)
    rest = list(resumed) + list(resumed)
    assert consumed + rest == expected


def test_state_at_end_of_epoch_resumes_at_next_epoch():
    reference = make_dm().train_dataloader()
    epochs = [list(reference) for _ in range(2)]
    loader = make_dm().train_dataloader()
    list(loader)
    resumed = make_dm().train_dataloader()
    resumed.load_state_dict(loader.state_dict())
    assert list(resumed) == epochs[1]


def test_load_state_dict_validates():
    loader = make_dm().train_dataloader()
    with pytest.raises(ValueError, match="seed"):
        loader.load_state_dict({"epoch": 0, "batch": 1, "seed": 123, "size": 20})
    with pytest.raises(ValueError, match="batch"):
        loader.load_state_dict({"epoch": 0, "batch": -1})


@pytest.mark.parametrize("train_size", [16, None])
def test_ranks_split_the_global_batches(train_size):
    task = get_task("arithmetic", digits=3)
    kwargs = dict(task=task, batch_size=2, seed=0, size=train_size, batches_per_epoch=4)
    one = PromptStream(**kwargs)
    single = prompts_of(list(one) + list(one))  # two single-rank epochs
    ranks = [PromptStream(**kwargs, rank=r, world_size=2) for r in range(2)]
    # finite: 16 / 2 = 8 global batches split over 2 ranks; infinite: batches_per_epoch is per rank
    assert len(ranks[0]) == len(ranks[1]) == 4
    interleaved = [p for pair in zip(*(list(r) for r in ranks)) for b in pair for p in b["prompt"]]
    assert interleaved == single[: len(interleaved)]


@pytest.mark.parametrize(
    "kwargs",
    [{"batch_size": 0}, {"val_size": -1}, {"train_size": 0}, {"task": "arithmetic"}, {"val_batch_size": 0}],
)
def test_bad_options(kwargs):
    with pytest.raises(ValueError):
        make_dm(**kwargs)


def test_too_few_distinct_prompts_for_disjointness():
    with pytest.raises(ValueError, match="val_size"):
        list(make_dm(task=get_task("arithmetic", digits=1), train_size=10, val_size=2000).train_dataloader())
