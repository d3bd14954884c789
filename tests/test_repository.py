"""The rendered Triton model repository: strict templates, names and wiring from protocol.py."""

import json
import re
import shutil

import pytest

from dflash_trt.config import BuildConfig
from dflash_trt.errors import BuildError, ConfigError
from dflash_trt.serving import protocol as p
from dflash_trt.serving.repository import (
    CONFIG_FILE,
    DRAFT_WINDOW_ENV,
    draft_window_from_env,
    engine_dir_from_args,
    render_repository,
    template_dir,
    tensor_parallel_from_env,
)

CONFIG = BuildConfig(max_batch_size=5, triton_max_batch_size=12)


@pytest.fixture
def output(tmp_path):
    """An output directory laid out as `build` writes it, with the repository rendered."""
    out = tmp_path / "out"
    (out / "engine").mkdir(parents=True)
    render_repository(out / "engine", out / "model_repository", CONFIG)
    return out


def rendered(output, model):
    return (output / "model_repository" / model / CONFIG_FILE).read_text()


def parse(text):
    model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2", reason="needs tritonclient[grpc]")
    text_format = pytest.importorskip("google.protobuf.text_format")
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def as_specs(tensors, inputs):
    from tritonclient.grpc import model_config_pb2

    return tuple(p.TensorSpec(t.name, model_config_pb2.DataType.Name(t.data_type).removeprefix("TYPE_"),
                              tuple(t.dims), t.optional if inputs else True) for t in tensors)


def test_every_model_is_rendered_with_a_version_directory_and_no_placeholder_left(output):
    repo = output / "model_repository"
    assert sorted(d.name for d in repo.iterdir()) == sorted(p.MODELS)
    for model in p.MODELS:
        assert (repo / model / "1").is_dir()
        assert "${" not in rendered(output, model), model
    for model in (p.PREPROCESSING, p.DFLASH, p.POSTPROCESSING, p.ENSEMBLE_UNARY):
        assert (repo / model / "1" / "model.py").is_file()
    assert not list(repo.rglob("__pycache__")) and not list(repo.rglob("__init__.py"))


@pytest.mark.parametrize("model", p.MODELS)
def test_rendered_tensors_are_exactly_those_of_protocol_py(output, model):
    config = parse(rendered(output, model))
    assert config.max_batch_size == CONFIG.triton_max_batch_size
    assert as_specs(config.input, inputs=True) == p.MODEL_INPUTS[model]
    outputs = tuple(p.TensorSpec(s.name, s.dtype, s.dims, True) for s in p.MODEL_OUTPUTS[model])
    assert as_specs(config.output, inputs=False) == outputs


def test_every_name_in_the_rendered_files_is_defined_in_protocol_py(output):
    known = {s.name for specs in (*p.MODEL_INPUTS.values(), *p.MODEL_OUTPUTS.values()) for s in specs}
    known |= {name for step in p.ENSEMBLE_STEPS for pairs in (step.inputs, step.outputs) for pair in pairs
              for name in pair}
    for model in p.MODELS:
        text = rendered(output, model)
        names = re.findall(r'name: "([^"]+)"', text) + re.findall(r'\b(?:key|value): "([^"]+)"', text)
        unknown = set(names) - known - set(p.MODELS) - {"engine_dir"}
        assert not unknown, (model, unknown)


def test_the_ensemble_wires_preprocessing_dflash_postprocessing_as_protocol_py_says(output):
    steps = parse(rendered(output, p.ENSEMBLE)).ensemble_scheduling.step
    assert [s.model_name for s in steps] == [p.PREPROCESSING, p.DFLASH, p.POSTPROCESSING]
    for step, want in zip(steps, p.ENSEMBLE_STEPS):
        assert dict(step.input_map) == dict(want.inputs) and dict(step.output_map) == dict(want.outputs)


def test_the_wiring_feeds_every_required_input_and_produces_every_ensemble_output():
    available = {s.name for s in p.ENSEMBLE_INPUTS}
    for step in p.ENSEMBLE_STEPS:
        model_inputs = {s.name: s for s in p.MODEL_INPUTS[step.model]}
        mapped = dict(step.inputs)
        assert set(mapped) <= set(model_inputs), step.model
        assert {n for n, s in model_inputs.items() if not s.optional} <= set(mapped), step.model
        assert set(mapped.values()) <= available, step.model
        assert set(dict(step.outputs)) <= {s.name for s in p.MODEL_OUTPUTS[step.model]}, step.model
        available |= set(dict(step.outputs).values())
    assert {s.name for s in p.ENSEMBLE_OUTPUTS} <= available


def test_only_the_dflash_model_is_decoupled_and_it_has_one_instance(output):
    for model in p.MODELS:
        config = parse(rendered(output, model))
        assert config.model_transaction_policy.decoupled == (model == p.DFLASH), model
    assert [g.count for g in parse(rendered(output, p.DFLASH)).instance_group] == [1]


def model_args(output, model):
    """What Triton's Python backend passes to initialize(): the model's directory and config."""
    config = parse(rendered(output, model))
    parameters = {k: {"string_value": v.string_value} for k, v in config.parameters.items()}
    return {"model_repository": str(output / "model_repository" / model),
            "model_config": json.dumps({"parameters": parameters})}


@pytest.mark.parametrize("model", [p.PREPROCESSING, p.DFLASH])
def test_models_find_the_engine_even_after_the_output_directory_moves(output, tmp_path, model):
    assert engine_dir_from_args(model_args(output, model)) == (output / "engine").resolve()
    moved = tmp_path / "elsewhere" / "moved"
    moved.parent.mkdir()
    shutil.move(output, moved)
    assert engine_dir_from_args(model_args(moved, model)) == (moved / "engine").resolve()


def test_a_repository_separated_from_its_engine_fails_with_a_clear_message(output, tmp_path):
    args = model_args(output, p.DFLASH)
    shutil.rmtree(output / "engine")
    with pytest.raises(ConfigError, match=r"engine_dir '../../engine' resolves to .*/out/engine, which is not a dir"):
        engine_dir_from_args(args)


@pytest.fixture
def templates(tmp_path):
    copy = tmp_path / "templates"
    shutil.copytree(template_dir(), copy)
    return copy


def test_a_template_key_without_a_value_fails_the_build_naming_template_and_key(templates, tmp_path):
    pbtxt = templates / p.DFLASH / CONFIG_FILE
    pbtxt.write_text(pbtxt.read_text() + 'parameters { key: "x" value: { string_value: "${kv_cache_fraction}" } }\n')
    with pytest.raises(BuildError, match=rf"{pbtxt}: template key 'kv_cache_fraction' has no value"):
        render_repository(tmp_path / "engine", tmp_path / "repo", CONFIG, templates=templates)


def test_a_malformed_placeholder_fails_the_build(templates, tmp_path):
    pbtxt = templates / p.ENSEMBLE / CONFIG_FILE
    pbtxt.write_text(pbtxt.read_text() + "# costs $5\n")
    with pytest.raises(BuildError, match=f"{pbtxt}: malformed template"):
        render_repository(tmp_path / "engine", tmp_path / "repo", CONFIG, templates=templates)


def test_rendering_into_a_non_empty_directory_fails(tmp_path):
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "stale").write_text("")
    with pytest.raises(BuildError, match="not empty"):
        render_repository(tmp_path / "engine", tmp_path / "repo", CONFIG)


@pytest.mark.parametrize("value, expected", [(None, None), ("0", 0), ("4096", 4096)])
def test_the_draft_window_override_comes_from_serves_environment(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(DRAFT_WINDOW_ENV, raising=False)
    else:
        monkeypatch.setenv(DRAFT_WINDOW_ENV, value)
    assert draft_window_from_env() == expected


def test_a_malformed_draft_window_override_names_the_variable(monkeypatch):
    monkeypatch.setenv(DRAFT_WINDOW_ENV, "-5")
    with pytest.raises(ConfigError, match="DFLASH_TRT_DRAFT_WINDOW_SIZE must be an int >= 0, got '-5'"):
        draft_window_from_env()
    monkeypatch.setenv("DFLASH_TRT_TENSOR_PARALLEL", "0")
    with pytest.raises(ConfigError, match="DFLASH_TRT_TENSOR_PARALLEL must be an int >= 1, got '0'"):
        tensor_parallel_from_env()
