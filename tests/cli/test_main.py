"""The command line's entry (``dynabatch.cli.main``): the version, Ctrl-C and SIGTERM."""

import os
import signal
import subprocess
import sys
import time

import pyarrow.dataset as ds
import pytest

from dynabatch import __version__
from dynabatch.cli import main
from dynabatch.cli._checks import Terminated, stop_on_sigterm, stopped_by

# Loaded by the command's process (a sitecustomize module): every store write waits a little, so the run is surely
# mid-way when the test presses Ctrl-C after the first shard. Where each process was when a Ctrl-C came is written to
# sigint.log beside it (Python's own handler still runs after): a failure says what the command was doing.
SLOW_WRITES = '''
import faulthandler
import os
import signal
import time

_SIGINT_LOG = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "sigint.log"), "a")
_SIGINT_LOG.write(f"process {os.getpid()} started\\n")
_SIGINT_LOG.flush()
faulthandler.register(signal.SIGINT, file=_SIGINT_LOG, all_threads=True, chain=True)

from dynabatch.inference import store, store_writer

store_writer.COMMIT = store_writer.CommitPolicy(rows=8)
_write = store.StoreWriter.write


def _slow_write(self, *args, **kwargs):
    time.sleep(0.3)
    return _write(self, *args, **kwargs)


store.StoreWriter.write = _slow_write
'''


def test_version_is_printed_without_a_command(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["--version"])
    assert stopped.value.code == 0
    assert capsys.readouterr().out.strip() == f"dynabatch {__version__} (torch-dynabatch)"


def test_sigterm_raises_where_ctrl_c_would_while_a_command_runs_then_its_handler_is_put_back(monkeypatch):
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated), stop_on_sigterm():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # not reached: the handler raises as the signal comes
    assert signal.getsignal(signal.SIGTERM) is before
    assert stopped_by(Terminated()) == ("SIGTERM", 143) and stopped_by(KeyboardInterrupt()) == ("Ctrl-C", 130)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")  # a torchrun rank: SIGTERM ends it at once, as before
    with stop_on_sigterm():
        assert signal.getsignal(signal.SIGTERM) is before


# The command's SIGINT as a terminal's foreground command has it. A shell starts a command it runs in the background
# (`pytest &` in a script, nohup) with SIGINT ignored, every process below inherits that, and Python then raises no
# KeyboardInterrupt (as it should: such a command is not the one a Ctrl-C is for). An exec keeps the default action.
AS_IN_A_TERMINAL = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                    "os.execv(sys.argv[1], sys.argv[1:])"]


# Ctrl-C in a terminal: SIGINT to the foreground process group; a scheduler's stop or `kill`: SIGTERM to the process.
@pytest.mark.parametrize("stop, name, status", [("ctrl-c", "Ctrl-C", 130), ("sigterm", "SIGTERM", 143)])
def test_a_stop_mid_run_is_one_line_of_what_was_kept_its_exit_status_and_the_same_command_resumes(
        stop, name, status, bert_dir, texts, tmp_path, cli, write_corpus, command_environment, run_command):
    corpus = write_corpus(tmp_path, texts, [f"t{i}" for i in range(len(texts))])
    out = tmp_path / "embeddings"
    command = [*cli, "embed", str(corpus), str(out), "--id-column", "id", "--model", str(bert_dir),
               "--batch-size", "4", "--no-progress"]
    process = subprocess.Popen([*AS_IN_A_TERMINAL, *command], env=command_environment(tmp_path / "hook", SLOW_WRITES),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not list(out.glob("part-*.parquet")):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no shard within 120 s"
        time.sleep(0.05)
    # Once: a KeyboardInterrupt raised in Python code whose exceptions Python drops (a weakref callback, such as one
    # per storage the CPU memory tracker frees) is lost, and the command would run on to its end.
    if stop == "ctrl-c":
        os.killpg(process.pid, signal.SIGINT)
    else:
        os.kill(process.pid, signal.SIGTERM)
    try:
        _, err = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"a {name} did not stop the command within 60 s; where its processes were at a Ctrl-C:\n" +
                    (tmp_path / "hook" / "sigint.log").read_text()[-20000:])
    stored = ds.dataset(out).count_rows()
    assert process.returncode == status, f"{err}\nwhere the command's processes were at a Ctrl-C:\n" + \
        (tmp_path / "hook" / "sigint.log").read_text()[-20000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (f"dynabatch embed: stopped ({name}): {stored:,} of {len(texts):,} texts "
                                            f"stored in {out}; the same command resumes")
    assert not list(out.glob(".lock-*")), "the store's job lock was not given up"
    assert 0 < stored < len(texts)
    again = run_command(command).stdout
    assert f"{len(texts)} of {len(texts)} texts stored in {out} ({len(texts) - stored} run now, {stored} stored " \
           "before)" in again


@pytest.mark.parametrize("argv", [["--help"], ["embed", "--help"], ["generate", "--help"], ["calibrate", "--help"],
                                  ["embed", "corpus/", "out/", "--batch-size", "0"],
                                  ["generate", "p.txt", "out/", "--model", "m", "--max-new-tokens", "0"],
                                  ["embed", "corpus/", "out/", "--no-such-flag"]])
def test_help_and_a_bad_option_answer_before_torch_is_imported(argv, cli, command_environment):
    """What a user types wrong is answered in a blink: torch (seconds to import) is not imported to say it."""
    code = ("import sys\nfrom dynabatch.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as stop:\n"
            "    print('exit', stop.code, 'torch' in sys.modules)\n")
    done = subprocess.run([cli[0], "-c", code, *argv], env=command_environment(), capture_output=True, text=True,
                          timeout=120, check=False)
    status = 0 if "--help" in argv else 2
    assert done.stdout.splitlines()[-1] == f"exit {status} False", done.stdout[-2000:] + done.stderr[-2000:]
    if status:
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize(("argv", "line"), [
    (["embed", "c.txt", "out/", "--normalise"],
     "dynabatch embed: error: unrecognized arguments: --normalise (did you mean --normalize?)"),
    (["embed", "c.txt", "out/", "--on-eror", "skip"],
     "dynabatch embed: error: unrecognized arguments: --on-eror skip (did you mean --on-error?)"),
    (["generate", "p.txt", "out/", "--model", "m", "--max-new-tokns=4"],
     "dynabatch generate: error: unrecognized arguments: --max-new-tokns=4 (did you mean --max-new-tokens?)"),
    (["calibrate", "--model", "m", "--batch-size", "2", "--max-length", "8", "-o", "m.json", "--plto", "p.png"],
     "dynabatch calibrate: error: unrecognized arguments: --plto p.png (did you mean --plot?)"),
    (["embed", "c.txt", "out/", "--xyz"], "dynabatch embed: error: unrecognized arguments: --xyz"),
])
def test_an_unknown_option_is_refused_by_its_command_with_the_option_it_likely_misspells(argv, line, capsys):
    # argparse said "dynabatch: error: unrecognized arguments: --normalise": the top parser's name, and no hint
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2 and capsys.readouterr().err == line + "\n"


def test_every_option_of_every_command_says_in_its_help_what_it_does():
    from dynabatch.cli import parser

    commands = next(a for a in parser()._actions if a.choices).choices  # the subcommands' parsers
    for name, command in commands.items():
        text = command.format_help()
        assert "``" not in text and "(default: None)" not in text, (name, text)  # no reST, no default of nothing
        bare = [a.option_strings or a.dest for a in command._actions if not (a.help or "").strip()]
        assert not bare, (name, bare)


def test_every_help_says_the_exit_statuses_and_calibrate_its_examples_and_defaults():
    # no help said what an exit status meant (is 0 with failed rows a success?), calibrate's had no example, no
    # default for --dtype and --texts, and "(default: False)" for a flag
    from dynabatch.cli import parser

    top = parser()
    commands = next(a for a in top._actions if a.choices).choices
    assert "exit status:\n  0    every input stored" in top.format_help()
    for name in ("embed", "generate"):
        assert "\n  130  Ctrl-C; 143 SIGTERM" in commands[name].format_help(), name
    calibrate = commands["calibrate"].format_help()
    assert "examples:\n  dynabatch calibrate --model" in calibrate and "exit status: 0 the memory model" in calibrate
    assert "default: float32)" in calibrate and "(default: probes of random token ids)" in calibrate
    assert "(default: False)" not in calibrate
