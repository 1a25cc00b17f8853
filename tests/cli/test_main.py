"""The command line's entry (``dynabatch.cli.main``): the version, Ctrl-C."""

import os
import signal
import subprocess
import time

import pyarrow.dataset as ds
import pytest

from dynabatch import __version__
from dynabatch.cli import main

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


def test_ctrl_c_mid_run_is_one_line_of_what_was_kept_exit_130_and_the_same_command_resumes(
        bert_dir, texts, tmp_path, cli, write_corpus, command_environment, run_command):
    corpus = write_corpus(tmp_path, texts, [f"t{i}" for i in range(len(texts))])
    out = tmp_path / "embeddings"
    command = [*cli, "embed", str(corpus), str(out), "--id-column", "id", "--model", str(bert_dir),
               "--batch-size", "4", "--no-progress"]
    process = subprocess.Popen(command, env=command_environment(tmp_path / "hook", SLOW_WRITES),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not list(out.glob("part-*.parquet")):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no shard within 120 s"
        time.sleep(0.05)
    # What Ctrl-C in a terminal sends: the foreground process group. Once: where Python code ran inside a freed
    # storage's weakref callback (the CPU memory tracker's, until it queued frees from C), Python dropped the
    # KeyboardInterrupt and the command ran on to its end.
    os.killpg(process.pid, signal.SIGINT)
    try:
        _, err = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail("a Ctrl-C did not stop the command within 60 s; where its processes were:\n" +
                    (tmp_path / "hook" / "sigint.log").read_text()[-20000:])
    stored = ds.dataset(out).count_rows()
    assert process.returncode == 130, f"{err}\nwhere the command's processes were at each Ctrl-C:\n" + \
        (tmp_path / "hook" / "sigint.log").read_text()[-20000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (f"dynabatch embed: stopped: {stored:,} of {len(texts):,} texts stored "
                                            f"in {out}; the same command resumes")
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
