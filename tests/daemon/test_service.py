"""The service as described once and rendered twice, its install steps, and the person's service commands."""

from __future__ import annotations

import dataclasses
import json
import os
import plistlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from support.cpus import APPLE_SILICON, ICE_LAKE, SAPPHIRE_RAPIDS, ZEN4, Cpu, fake_build, fake_timings, simulate

from npumoe.daemon.cli import main
from npumoe.daemon.cli.service import _linger_check
from npumoe.daemon.config import ModelConfig
from npumoe.daemon.heartbeat import EXIT_STUCK
from npumoe.daemon.home import Home
from npumoe.daemon.logs import setup_logging
from npumoe.daemon.model_choice import DEMO_WEIGHTS
from npumoe.daemon.service import (
    EXIT_DO_NOT_RESTART,
    LABEL,
    Launchd,
    Remove,
    Run,
    Service,
    ServiceError,
    SystemdUser,
    Write,
    carry_out,
    lingering,
)
from npumoe.engine.kernels import attention_choice, float_kernels, quant_kernels
from npumoe.engine.kernels.choice import Accuracy
from npumoe.engine.kernels.host import cpu_model
from npumoe.jobs.queue.store import BATCH, Queue

ODD_HOME = "my docs & <notes> 100% $HOME"  # every character the two formats must escape


@pytest.fixture
def service(tmp_path: Path) -> Service:
    return Service.for_home(Home(tmp_path / ODD_HOME))


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("NPUMOED_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path / "home"


def npumoed(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


class Recorder:
    """Stands in for launchctl / systemctl: records each command and answers with a set exit status."""

    def __init__(self, failing: tuple[str, ...] = ()) -> None:
        self.failing = failing
        self.commands: list[tuple[str, ...]] = []

    def __call__(self, argv: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
        self.commands.append(tuple(argv))
        failed = any(word in argv for word in self.failing)
        return subprocess.CompletedProcess(argv, 5 if failed else 0, "", "Boot-out failed: 3: No such process"
                                           if failed else "")


# -- the LaunchAgent --------------------------------------------------------------------------------

def test_the_launch_agent_parses_and_has_every_key_launchd_needs(tmp_path: Path, service: Service) -> None:
    agent = plistlib.loads(Launchd(tmp_path, uid=501).render(service).encode())
    home = tmp_path / ODD_HOME
    assert agent["Label"] == LABEL
    assert agent["ProgramArguments"] == [sys.executable, "-m", "npumoe.daemon", "run"]
    assert Path(agent["ProgramArguments"][0]).is_absolute()
    assert agent["EnvironmentVariables"]["NPUMOED_HOME"] == str(home)
    assert agent["WorkingDirectory"] == str(home)
    assert agent["RunAtLoad"] is True
    assert agent["ProcessType"] == "Background"
    assert agent["LowPriorityIO"] is True
    assert agent["ThrottleInterval"] == 30
    assert Path(agent["StandardOutPath"]).parent == home / "logs"
    assert Path(agent["StandardErrorPath"]).parent == home / "logs"


def launchd_restarts(keep_alive: dict[str, bool], *, status: int = 0, crashed: bool = False) -> bool:
    """What launchd.plist(5) says KeepAlive does when the job ends: `SuccessfulExit` false restarts it after an
    exit other than 0, `Crashed` true after a crash (a signal)."""
    return (crashed and keep_alive.get("Crashed", False)) or (
        (status != 0 or crashed) and keep_alive.get("SuccessfulExit") is False)


def test_the_launch_agent_restarts_the_daemon_after_a_stall_a_failing_exit_or_a_crash(
    tmp_path: Path, service: Service
) -> None:
    keep_alive = plistlib.loads(Launchd(tmp_path, uid=501).render(service).encode())["KeepAlive"]
    assert launchd_restarts(keep_alive, status=EXIT_STUCK)  # a call that never returned: the README's promise
    assert launchd_restarts(keep_alive, status=1) and launchd_restarts(keep_alive, crashed=True)
    assert not launchd_restarts(keep_alive, status=0)  # told to stop: stays stopped


def test_a_config_file_given_at_install_is_passed_to_the_service(tmp_path: Path) -> None:
    service = Service.for_home(Home(tmp_path), tmp_path / "my.toml")
    assert service.program[-3:] == ("--config", str(tmp_path / "my.toml"), "run")


def test_launchd_install_bootstraps_into_the_gui_domain(tmp_path: Path, service: Service) -> None:
    launchd = Launchd(tmp_path, uid=501)
    plist = tmp_path / f"{LABEL}.plist"
    steps = launchd.install(service)
    assert steps[0] == Write(plist, launchd.render(service))
    assert steps[1:] == [Run(("launchctl", "bootout", f"gui/501/{LABEL}"), must_succeed=False),
                         Run(("launchctl", "bootstrap", "gui/501", str(plist)))]
    assert launchd.uninstall() == [Run(("launchctl", "bootout", f"gui/501/{LABEL}"), must_succeed=False),
                                   Remove(plist)]


def test_launchd_state_reads_launchctl_print(tmp_path: Path, service: Service) -> None:
    launchd = Launchd(tmp_path, uid=501)
    assert launchd.state(Recorder()) == "not installed"
    carry_out(launchd.install(service), Recorder())

    def answer(argv: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(argv, 0, f"{LABEL} = {{\n\tstate = running\n\tpid = 4242\n}}\n", "")

    assert launchd.state(answer) == "installed, running (pid 4242)"


# -- the systemd unit -------------------------------------------------------------------------------

def test_the_systemd_unit_runs_the_daemon_idle_and_restarts_on_failure(tmp_path: Path, service: Service) -> None:
    unit = SystemdUser(tmp_path).render(service)
    lines = set(unit.splitlines())
    assert {"Nice=19", "CPUSchedulingPolicy=idle", "IOSchedulingClass=idle", "Restart=on-failure",
            "WantedBy=default.target"} <= lines
    assert f'ExecStart="{sys.executable}" "-m" "npumoe.daemon" "run"' in lines
    assert f"RestartPreventExitStatus={EXIT_DO_NOT_RESTART}" in lines  # a damaged database: no restart loop


CACHES = {"HF_HOME": "/data/hf home", "HF_HUB_CACHE": "/data/hub", "TRANSFORMERS_CACHE": "/data/tf",
          "NPUMOE_CACHE": "/data/npumoe 100%"}


def test_the_caches_set_at_install_time_reach_the_service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in CACHES.items():
        monkeypatch.setenv(name, value)
    service = Service.for_home(Home(tmp_path / "home"))
    agent = plistlib.loads(Launchd(tmp_path, uid=501).render(service).encode())
    assert {k: agent["EnvironmentVariables"][k] for k in CACHES} == CACHES
    assert agent["EnvironmentVariables"]["NPUMOED_SERVICE"] == "1"
    unit = SystemdUser(tmp_path).render(service).splitlines()
    assert 'Environment="NPUMOE_CACHE=/data/npumoe 100%%"' in unit and 'Environment="HF_HOME=/data/hf home"' in unit
    assert 'Environment="NPUMOED_SERVICE=1"' in unit


def test_caches_not_set_at_install_time_are_left_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in CACHES:
        monkeypatch.delenv(name, raising=False)
    service = Service.for_home(Home(tmp_path / "home"))
    assert set(service.environment) == {"NPUMOED_HOME", "PYTHONUNBUFFERED", "NPUMOED_SERVICE"}


def test_under_the_service_each_log_line_goes_once_to_the_rotating_file(home: Path) -> None:
    env = {**os.environ, "NPUMOED_HOME": str(home), "NPUMOED_SERVICE": "1"}
    result = subprocess.run([sys.executable, "-m", "npumoe.daemon", "run", "--once"], capture_output=True,
                            text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # the service appends stderr to a file that never rotates
    assert "npumoed" in result.stdout and "started" in (home / "logs" / "npumoed.log").read_text()
    by_hand = subprocess.run([sys.executable, "-m", "npumoe.daemon", "run", "--once"], capture_output=True,
                             text=True, timeout=120, env={**env, "NPUMOED_SERVICE": ""})
    assert "started" in by_hand.stderr  # in a terminal the person sees the log as well


def test_setup_logging_without_stderr_has_only_the_rotating_file(tmp_path: Path) -> None:
    import logging
    from logging.handlers import RotatingFileHandler

    setup_logging(tmp_path / "logs", to_stderr=False)
    handlers = logging.getLogger("npumoe").handlers
    assert [type(h) for h in handlers] == [RotatingFileHandler]
    setup_logging(tmp_path / "logs")
    assert len(logging.getLogger("npumoe").handlers) == 2


def test_lingering_is_read_from_logind_and_doctor_says_how_to_turn_it_on(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    linger = tmp_path / "linger"
    linger.mkdir()
    assert not lingering("ada", linger)
    (linger / "ada").touch()
    assert lingering("ada", linger)
    monkeypatch.setattr("npumoe.daemon.cli.service.lingering", lambda user: False)
    check = _linger_check("ada")
    assert check["status"] == "warn" and "`loginctl enable-linger ada`" in check["detail"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (apt-get install systemd provides it)")
def test_the_systemd_unit_passes_systemd_analyze_verify(tmp_path: Path, service: Service) -> None:
    units = tmp_path / "units"
    carry_out(SystemdUser(units).install(service)[:1])
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    result = subprocess.run(["systemd-analyze", "--user", "verify", str(units / "npumoed.service")],
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)})
    # verify prints problems it can live with as warnings and still exits 0, so both must be clean
    assert (result.returncode, result.stderr) == (0, "")


def test_systemd_install_reloads_enables_and_restarts(tmp_path: Path, service: Service) -> None:
    systemd = SystemdUser(tmp_path)
    recorder = Recorder()
    carry_out(systemd.install(service), recorder)
    assert (tmp_path / "npumoed.service").read_text() == systemd.render(service)
    assert recorder.commands == [("systemctl", "--user", "daemon-reload"),
                                 ("systemctl", "--user", "enable", "npumoed.service"),
                                 ("systemctl", "--user", "restart", "npumoed.service")]


def test_uninstall_goes_on_when_the_service_was_not_running(tmp_path: Path, service: Service) -> None:
    systemd = SystemdUser(tmp_path)
    carry_out(systemd.install(service), Recorder())
    recorder = Recorder(failing=("disable",))
    carry_out(systemd.uninstall(), recorder)
    assert not (tmp_path / "npumoed.service").exists()
    assert recorder.commands[-1] == ("systemctl", "--user", "daemon-reload")


def test_a_failing_step_stops_the_install_and_names_the_command(tmp_path: Path, service: Service) -> None:
    recorder = Recorder(failing=("restart",))
    with pytest.raises(ServiceError, match=re.escape("`systemctl --user restart npumoed.service` failed: Boot-out")):
        carry_out(SystemdUser(tmp_path).install(service), recorder)


def test_a_missing_service_manager_is_a_clear_error() -> None:
    with pytest.raises(ServiceError, match="`no-such-launchctl print` failed: no-such-launchctl: command not found"):
        carry_out([Run(("no-such-launchctl", "print"))])


# -- the commands -----------------------------------------------------------------------------------

@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the Linux service manager")
def test_install_dry_run_prints_the_unit_and_commands_and_writes_nothing(home: Path, tmp_path: Path) -> None:
    result = npumoed("install", "--dry-run")
    unit = tmp_path / "config" / "systemd" / "user" / "npumoed.service"
    assert result.exit_code == 0
    assert f"write {unit}:" in result.output and "CPUSchedulingPolicy=idle" in result.output
    assert "run systemctl --user enable npumoed.service" in result.output
    assert not unit.exists() and not home.exists()
    removal = npumoed("uninstall", "--dry-run")
    assert f"remove {unit}" in removal.output and "systemctl --user disable --now npumoed.service" in removal.output


def test_pause_and_resume_set_the_switch_the_scheduler_reads(home: Path) -> None:
    assert "paused" in npumoed("pause").output
    paused = Queue(Home(home).database).controls.get("paused")
    assert paused is not None and paused["since"] > 0
    assert "already paused since" in npumoed("pause").output
    assert npumoed("resume").output.strip() == "resumed"
    assert Queue(Home(home).database).controls.get("paused") is None
    assert npumoed("resume").output.strip() == "was not paused"


def test_batch_queues_documents_for_the_window_at_low_priority(home: Path, tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in ("a.txt", "b.md"):
        (docs / name).write_text(f"the text of {name}")
    result = npumoed("batch", str(docs), "--window", "22:00-06:00", "--json")
    assert result.exit_code == 0
    jobs = json.loads(result.output)["jobs"]
    assert [(j["priority"], j["batch_window"]) for j in jobs] == [(BATCH, "22:00-06:00")] * 2


def test_batch_uses_the_configured_window_by_default(home: Path, tmp_path: Path) -> None:
    doc = tmp_path / "a.txt"
    doc.write_text("text")
    result = npumoed("batch", str(doc))
    assert result.exit_code == 0 and "will run between 01:00-06:00 on AC power" in result.output
    assert Queue(Home(home).database).list()[0].batch_window == "01:00-06:00"


def test_batch_with_a_bad_window_is_refused(home: Path, tmp_path: Path) -> None:
    doc = tmp_path / "a.txt"
    doc.write_text("text")
    result = npumoed("batch", str(doc), "--window", "1am-6am")
    assert result.exit_code == 2 and "'1am-6am' must look like HH:MM-HH:MM" in result.output


def test_doctor_reports_every_area(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NPUMOE_MODELS", str(tmp_path / "models"))  # no demo model made yet: doctor says so, loads none
    result = npumoed("doctor", "--json")
    checks = {c["check"]: c for c in json.loads(result.output)["checks"]}
    assert result.exit_code == 0, checks
    assert checks[f"inbox {home / 'inbox'}"]["status"] == "ok"
    backends = next(f for f in dataclasses.fields(ModelConfig) if f.name == "backend").metadata["choices"]
    assert {"power state", "foreground load", "CPU budget", "energy", "cpu kernel",
            *(f"backend {name}" for name in backends)} <= checks.keys()
    assert any(name.startswith("service") for name in checks)
    assert checks["backend cpu"]["status"] == "ok"
    assert checks["queue database"]["status"] == "ok" and "quick_check ok" in checks["queue database"]["detail"]


@pytest.mark.parametrize("cpu", [ZEN4, SAPPHIRE_RAPIDS], ids=lambda cpu: cpu.name)
def test_doctor_warns_when_the_cpu_could_run_the_bf16_kernel_but_it_does_not_build(home: Path, tmp_path: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                                   cpu: Cpu) -> None:
    simulate(monkeypatch, cpu)
    fake_build(monkeypatch, tmp_path, fails=True)
    fake_timings(monkeypatch, tmp_path / "cache", fastest="onednn")  # the simulated oneDNN is never run
    check = {c["check"]: c for c in json.loads(npumoed("doctor", "--json").output)["checks"]}["cpu kernel"]
    assert check["status"] == "warn"
    assert "npumoe-bf16 cannot: " in check["detail"] and "could not build" in check["detail"]


@pytest.mark.parametrize("cpu", [ICE_LAKE, APPLE_SILICON], ids=lambda cpu: cpu.name)
def test_doctor_does_not_warn_where_the_cpu_cannot_run_the_bf16_kernel(home: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       cpu: Cpu) -> None:
    simulate(monkeypatch, cpu)
    fake_timings(monkeypatch, tmp_path / "cache", fastest="onednn")
    check = {c["check"]: c for c in json.loads(npumoed("doctor", "--json").output)["checks"]}["cpu kernel"]
    assert check["status"] == "ok"
    assert "npumoe-bf16 cannot: " in check["detail"]


def test_doctor_names_the_chosen_cpu_kernel_and_the_figures_that_chose_it(home: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    timings = fake_timings(monkeypatch, tmp_path / "cache", fastest="npumoe-bf16")
    monkeypatch.setattr(float_kernels, "unavailable_kernels", lambda *weights: {})
    detail = {c["check"]: c for c in json.loads(npumoed("doctor", "--json").output)["checks"]}["cpu kernel"]["detail"]
    assert detail.startswith("bfloat16 hidden 2048 ffn 768 threads 1 (qwen3-30b-a3b): npumoe-bf16 (npumoe-bf16 1 ms, "
                             "onednn 2 ms, torch 3 ms)")
    assert f"on {cpu_model()}, torch {torch.__version__}" in detail
    npumoed("doctor", "--json")
    assert len(timings.calls) == 1  # the second doctor reads the choice the first one made


def test_doctor_lists_every_measured_choice_attention_included_with_its_figures(
        home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_timings(monkeypatch, tmp_path / "cache", fastest="npumoe-bf16")
    monkeypatch.setattr(float_kernels, "unavailable_kernels", lambda *weights: {})

    def measured() -> dict:
        return {c["check"]: c for c in json.loads(npumoed("doctor", "--json").output)["checks"]}["measured choices"]

    assert measured()["detail"] == ("float kernels: bfloat16 hidden 2048 ffn 768 threads 1: npumoe-bf16 (npumoe-bf16 "
                                    "1 ms, onednn 2 ms, torch 3 ms)")  # the reference doctor measures, alone
    threads = torch.get_num_threads()
    attention_choice.CHOICES.choose(torch.bfloat16, {"heads": 32, "kv_heads": 4, "head_dim": 128}, ["npumoe", "torch"],
                                    lambda _: {"npumoe": 0.01, "torch": 0.02}, threads=threads)
    quant_kernels.CHOICES.choose(torch.bfloat16, {"format": "int8", "hidden": 2048, "ffn": 768},
                                 ["npumoe-int8-amx-dynamic", "int8pack"],
                                 lambda _: {"npumoe-int8-amx-dynamic": 0.001, "int8pack": 0.004}, threads=1,
                                 unavailable={"onednn-dynamic": "no oneDNN here"})
    assert measured()["detail"] == (
        f"attention: bfloat16 heads 32 kv_heads 4 head_dim 128 threads {threads}: npumoe (npumoe 10 ms, torch 20 ms) "
        "| float kernels: bfloat16 hidden 2048 ffn 768 threads 1: npumoe-bf16 (npumoe-bf16 1 ms, onednn 2 ms, "
        "torch 3 ms) | quantized kernels: bfloat16 format int8 hidden 2048 ffn 768 threads 1: npumoe-int8-amx-dynamic "
        "(npumoe-int8-amx-dynamic 1 ms, int8pack 4 ms; onednn-dynamic cannot: no oneDNN here)")


def test_doctor_shows_a_kernel_the_probe_refused_beside_the_choice(home: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    fake_timings(monkeypatch, tmp_path / "cache", fastest="npumoe-bf16")
    monkeypatch.setattr(float_kernels, "unavailable_kernels", lambda *weights: {})
    quant_kernels.CHOICES.choose(torch.bfloat16, {"format": "int8", "hidden": 2048, "ffn": 768},
                                 ["onednn-dynamic", "int8pack"], lambda names: {name: 0.004 for name in names},
                                 threads=1, probe=lambda names: {"onednn-dynamic": Accuracy(0.037, 0.012),
                                                                 "int8pack": Accuracy(0.002, 0.004)})
    detail = {c["check"]: c for c in json.loads(npumoed("doctor", "--json").output)["checks"]}["measured choices"]
    assert detail["detail"].endswith(
        "quantized kernels: bfloat16 format int8 hidden 2048 ffn 768 threads 1: int8pack (int8pack 4 ms; "
        "onednn-dynamic refused: relative error 0.037 against the reference, above its bound 0.012)")


def _weights_check(*args: str) -> dict:
    return {c["check"]: c for c in json.loads(npumoed(*args, "doctor", "--json").output)["checks"]}["weights"]


def test_doctor_says_what_weights_auto_chooses_here_and_why(home: Path, tmp_path: Path, tiny,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from npumoe.engine.loading import auto_weights

    timed = []

    def seconds(hidden: int, ffn: int, dtype: torch.dtype) -> float:
        timed.append(str(dtype))
        return 1e-3 if dtype == torch.bfloat16 else 3e-3

    monkeypatch.setenv("NPUMOE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(auto_weights, "expert_seconds", seconds)
    config = tmp_path / "config.toml"
    config.write_text(f"[model]\nname = '{tiny('qwen3_moe')}'\n")
    check = _weights_check("--config", str(config))
    assert (check["status"], check["weights"]) == ("ok", "bf16") and len(timed) == 2
    assert check["detail"].startswith("auto -> bf16, the fastest float dtype measured here per expert (fp32 3 ms, "
                                      "bf16 1 ms); needs ")
    assert _weights_check("--config", str(config)) == check and len(timed) == 2  # measured once on this machine


def test_doctor_names_weights_set_in_the_config_and_the_demo_models_own_format(home: Path, tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text("[model]\nweights = 'int8'\n")
    check = _weights_check("--config", str(config))
    assert (check["status"], check["detail"], check["weights"]) == ("ok", "int8, set by [model] weights", "int8")
    check = _weights_check()  # the default: auto, for the demo model, which the daemon runs in DEMO_WEIGHTS
    assert (check["status"], check["weights"]) == ("ok", DEMO_WEIGHTS) == ("ok", "fp32")
    assert check["detail"].startswith("auto -> fp32, the demo model's format")
    assert not any((home / "models").iterdir())  # doctor made no model


def test_doctor_fits_one_screen_on_the_demo_home_and_keeps_the_figures_for_verbose(
        home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_timings(monkeypatch, tmp_path / "cache", fastest="npumoe-bf16")
    monkeypatch.setattr(float_kernels, "unavailable_kernels", lambda *weights: {})
    for heads in range(1, 41):  # a machine that has measured many choices, as one that ran a few models has
        attention_choice.CHOICES.choose(torch.bfloat16, {"heads": heads, "kv_heads": 1, "head_dim": 64},
                                        ["npumoe", "torch"], lambda _: {"npumoe": 0.01, "torch": 0.02}, threads=1)
    monkeypatch.setenv("COLUMNS", "120")
    lines = npumoed("doctor").output.splitlines()
    assert len(lines) <= 40 and max(map(len, lines)) <= 120, lines
    assert "ok    measured choices: 41 cached (attention 40, float kernels 1)" in lines
    assert "ok    weights: auto -> fp32, the demo model's format: a 135M model's summaries change in bf16" in lines
    verbose = npumoed("doctor", "--verbose").output
    assert all(f"bfloat16 heads {heads} kv_heads 1 head_dim 64 threads 1: npumoe (npumoe 10 ms, torch 20 ms)"
               in " ".join(verbose.split()) for heads in range(1, 41))
    assert max(map(len, verbose.splitlines())) <= 120


def test_a_long_inbox_path_keeps_its_end_and_the_reason_on_doctors_line(home: Path, tmp_path: Path) -> None:
    folder = tmp_path / ("a-folder-with-a-long-name-" * 5) / "nowhere"
    config = tmp_path / "config.toml"
    config.write_text(f"[inbox]\nfolders = ['{folder}']\n")
    lines = npumoed("--config", str(config), "doctor").output.splitlines()
    (line,) = [line for line in lines if line.split()[1] == "inbox"]
    assert len(line) <= 120 and line.startswith("FAIL  inbox …")
    assert line.endswith("-long-name-/nowhere: missing or not a folder")


def test_doctor_fails_on_an_inbox_it_cannot_use(home: Path, tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f"[inbox]\nfolders = ['{tmp_path / 'nowhere'}']\n")
    result = npumoed("--config", str(config), "doctor")
    assert result.exit_code == 1
    assert f"inbox {tmp_path / 'nowhere'}: missing or not a folder" in result.output
