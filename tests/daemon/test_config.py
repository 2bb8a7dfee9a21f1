"""Config files: defaults for every key, and one clear error naming the file and the key."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from npumoe.daemon.cli import main
from npumoe.daemon.config import Config, ConfigError, ModelConfig, load_config
from npumoe.daemon.config_file import replace_config, with_section


def write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(body)
    return path


def test_an_empty_file_means_every_default(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "")) == Config()


def test_values_override_defaults_and_ints_count_as_floats(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, '[model]\nbackend = "torch-static"\n[inbox]\nstable_seconds = 5\n'
                                         'folders = ["~/Inbox"]\n'))
    assert config.model.backend == "torch-static"
    assert config.inbox.stable_seconds == 5.0 and config.inbox.folders == ["~/Inbox"]
    assert config.queue == Config().queue


@pytest.mark.parametrize(("body", "message"), [
    ("[model\n", "not valid TOML"),
    ("[modle]\n", "unknown key 'modle'"),
    ("[model]\nbackends = 'cpu'\n", "unknown key 'model.backends'"),
    ("[model]\nbackend = 'gpu'\n", "'model.backend' must be one of cpu, torch-static, coreml"),
    ("[model]\nchunk_tokens = '512'\n", "'model.chunk_tokens' must be an integer"),
    ("[model]\nchunk_tokens = true\n", "'model.chunk_tokens' must be an integer"),
    ("[queue]\nlease_seconds = -1\n", "'queue.lease_seconds' must not be negative"),
    ("[model]\nsection_tokens = -512\n", "'model.section_tokens' must not be negative"),
    ("[scheduler]\nbatch_window = '1am-6am'\n", "'scheduler.batch_window' must look like HH:MM-HH:MM"),
    ("[inbox]\nfolders = '/x'\n", "'inbox.folders' must be a list of strings"),
    ("model = 3\n", "[model] must be a table"),
])
def test_bad_files_name_the_file_and_the_key(tmp_path: Path, body: str, message: str) -> None:
    path = write(tmp_path, body)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value).startswith(f"{path}: ")
    assert message in str(error.value)


def test_a_named_file_that_does_not_exist_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.toml")


def test_weights_is_the_one_key_for_the_format_and_defaults_to_auto(tmp_path: Path) -> None:
    assert (Config().model.weights, Config().model.dtype) == ("auto", "")
    assert load_config(write(tmp_path, '[model]\nweights = "int8"\n')).model.weights == "int8"


@pytest.mark.parametrize(("dtype", "weights"), [("float32", "fp32"), ("bfloat16", "bf16")])
def test_a_dtype_from_before_weights_pins_its_float_format_and_says_it_is_deprecated(tmp_path: Path, caplog,
                                                                                      dtype: str, weights: str) -> None:
    with caplog.at_level("WARNING", logger="npumoe.daemon.config"):
        model = load_config(write(tmp_path, f'[model]\ndtype = "{dtype}"\n')).model
    assert (model.weights, model.dtype) == (weights, "")
    assert 'dtype is deprecated' in caplog.text and f'weights = "{weights}"' in caplog.text


def test_a_dtype_that_agrees_with_weights_is_only_deprecated_and_one_that_disagrees_is_an_error(tmp_path: Path,
                                                                                                caplog) -> None:
    with caplog.at_level("WARNING", logger="npumoe.daemon.config"):
        model = load_config(write(tmp_path, '[model]\nweights = "int4"\ndtype = "bfloat16"\n')).model
    assert (model.weights, model.dtype) == ("int4", "") and "deprecated" in caplog.text
    with pytest.raises(ConfigError, match=r"config.toml: \[model\] dtype 'float32' disagrees with weights 'int8', "
                                          r"whose float dtype is bfloat16; dtype is deprecated: remove it"):
        load_config(write(tmp_path, '[model]\nweights = "int8"\ndtype = "float32"\n'))
    with pytest.raises(ConfigError, match=r"'model\.weights' must be one of auto, fp32, bf16, int8, int4, got ''"):
        load_config(write(tmp_path, '[model]\nweights = ""\n'))


def test_a_plan_is_calibrated_at_the_configured_chunk_length_or_the_default_where_it_is_measured() -> None:
    assert ModelConfig(chunk_tokens=256).plan_chunk_tokens == 256
    assert ModelConfig(chunk_tokens=0).plan_chunk_tokens == 512


def test_a_private_config_file_rewritten_in_place_stays_private(tmp_path: Path) -> None:
    path = write(tmp_path, '[queue]\nurl = "postgresql://npumoed:s3cret@db.local/jobs"\n')
    path.chmod(0o600)
    old = os.umask(0o022)
    try:
        _, new = with_section(path, "model", {"backend": "torch-static"})
        replace_config(path, new)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "config.toml.bak").stat().st_mode) == 0o600
    assert load_config(path).model.backend == "torch-static"


@pytest.mark.parametrize("as_json", [False, True])
def test_config_show_hides_the_queue_servers_password(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      as_json: bool) -> None:
    monkeypatch.setenv("NPUMOED_HOME", str(tmp_path))
    write(tmp_path, '[queue]\nurl = "postgresql://npumoed:s3cret@db.local:5433/jobs?password=s3cret"\n')
    shown = CliRunner().invoke(main, ["config", "show", *(["--json"] if as_json else [])])
    assert shown.exit_code == 0, shown.output
    assert "s3cret" not in shown.output
    assert "postgresql://npumoed:***@db.local:5433/jobs?password=***" in shown.output


@pytest.mark.parametrize("as_json", [False, True])
def test_config_show_hides_every_secret_the_queue_url_can_carry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                as_json: bool) -> None:
    """libpq reads a password from more keys than `password`: the client key's passphrase is `sslpassword`."""
    monkeypatch.setenv("NPUMOED_HOME", str(tmp_path))
    url = ("postgresql://npumoed@db.local/jobs?sslmode=verify-full&sslkey=/keys/client.key&sslpassword=k3y-pass"
           "&PASSWORD=upper-s3cret")
    write(tmp_path, f'[queue]\nurl = "{url}"\n')
    shown = CliRunner().invoke(main, ["config", "show", *(["--json"] if as_json else [])])
    assert shown.exit_code == 0, shown.output
    assert "k3y-pass" not in shown.output and "upper-s3cret" not in shown.output
    assert ("postgresql://npumoed@db.local/jobs?sslmode=verify-full&sslkey=/keys/client.key&sslpassword=***"
            "&PASSWORD=***") in shown.output  # where the key file is helps; its passphrase is hidden
