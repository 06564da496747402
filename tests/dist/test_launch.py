"""`edge0 launch`: its refusals are one line naming the flag, before anything starts."""

import json
import subprocess
import sys

import pytest

from edge0.cli import main

from .common import free_port


@pytest.mark.parametrize("argv, says", [
    (["--", "chat"], "name the command to run across ranks after --: run or serve"),
    (["-n", "1", "--", "run"], "-n 1: from 2 to 64 ranks"),
    (["--", "run"], "give -n N (ranks on this machine) or --hostfile FILE"),
    (["-n", "2", "--hostfile", "hosts.json", "--", "run"], "give -n N (ranks on this machine) or --hostfile FILE"),
    (["--hostfile", "no/such/hosts.json", "--", "run"], "--hostfile no/such/hosts.json: no such file"),
    (["-n", "2", "--port", "80", "--", "run"], "--port 80: from 1024 to 65000"),
    (["-n", "2", "--split", "2,x", "--", "run"], "--split 2,x: choose even, cost or layer counts such as 3,3"),
    (["-n", "2", "--rank-timeout", "0", "--", "serve"], "--rank-timeout 0: seconds, more than 0 and at most 86400"),
    # the built-in model has 6 layers (edge0/model/demo/store/config.json)
    (["-n", "2", "--split", "9,9", "--", "run"], "--split 9,9: must be 2 counts of at least 1 layer that add up to the "
                                                 "model's 6"),
    (["-n", "2", "--split", "2,2,2", "--", "run"], "--split 2,2,2: must be 2 counts"),
    (["-n", "7", "--", "run"], "7 ranks for a model of 6 layers: at most one rank per layer"),
    (["-n", "2", "--parallel", "experts", "--split", "cost", "--", "run"], "--split cost: splits layers, for "
                                                                          "--parallel pipeline only"),
])
def test_refusals(argv, says, capsys):
    assert main(["launch", *argv]) != 0
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


HOSTS = [{"ssh": "mac1", "ips": ["192.168.1.10"]}, {"ssh": "mac2", "ips": ["192.168.1.11"]}]


@pytest.mark.parametrize("text, says", [
    ("[{\"ssh\": \"mac1\",", "not JSON (Expecting"),
    ("\"mac1\"", "expected a list of hosts"),
    (json.dumps({"hosts": HOSTS[:1]}), "1 host(s); name at least 2"),
    (json.dumps([HOSTS[0], {"ips": ["192.168.1.11"]}]), "host 1: \"ssh\" must name the host"),
    (json.dumps([HOSTS[0], {"ssh": "mac2", "ips": ["mac2.local"]}]), "host 1: \"ips\": 'mac2.local' is not an IP"),
    (json.dumps([HOSTS[0], {"ssh": "mac2"}]), "host 1: the ring backend needs its \"ips\""),
    (json.dumps({"backend": "tcp", "hosts": HOSTS}), "\"backend\" 'tcp': choose ring, jaccl, jaccl-ring"),
])
def test_damaged_hostfile_is_one_line_naming_it(tmp_path, capsys, text, says):
    path = tmp_path / "hosts.json"
    path.write_text(text)
    assert main(["launch", "--hostfile", str(path), "--", "run"]) != 0
    err = capsys.readouterr().err
    assert f"--hostfile {path}: " in err and says in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_hostfile_counts_the_ranks_for_split(tmp_path, capsys):
    """Two hosts: --split names two counts (three is refused before any host is reached)."""
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(HOSTS))
    assert main(["launch", "--hostfile", str(path), "--split", "2,2,2", "--", "run"]) != 0
    assert "--split 2,2,2: must be 2 counts" in capsys.readouterr().err


def test_split_counts_for_a_store_not_here(tmp_path, capsys):
    """A --model not on this machine: the counts are checked against the ranks only, not a guessed layer count."""
    argv = ["launch", "-n", "3", "--split", "1,1", "--", "run", "--model", str(tmp_path / "elsewhere")]
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert "--split 1,1: must be 3 counts of at least 1 layer" in err and "model of" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_record_routes_is_refused_across_ranks(tmp_path):
    """--record-routes under a launch: each rank would write its own layers' routing to the same path; no file. Every
    rank refuses it alike: the launcher says it once, without mlx.launch's lines on the ranks' exits."""
    out = tmp_path / "routes.json"
    run = subprocess.run([sys.executable, "-m", "edge0.cli", "launch", "-n", "2", "--port", str(free_port()), "--",
                          "run", "--max-tokens", "2", "--record-routes", str(out)], capture_output=True, text=True,
                         timeout=60)
    errors = [line for line in run.stderr.splitlines() if "--record-routes" in line]
    assert run.returncode != 0 and len(errors) == 1 and "not under edge0 launch" in errors[0], run.stderr
    assert "Node with rank" not in run.stderr and not out.exists(), run.stderr


def test_an_unreached_host_is_one_line_without_mlx_launchs_traceback(capfd):
    """mlx.launch's stderr when ssh reached neither host (as seen with hosts named *.invalid): a rank's exit 255, then
    its cleanup thread's traceback; the launcher says why once and leaves the traceback out."""
    from edge0.cli.launch import run_ranks

    seen = ("[WARN] Node with rank 0 exited with code 255\nException in thread Thread-2 (_thread_fn):\n"
            "Traceback (most recent call last):\n  File \"launch.py\", line 97, in terminate\n    c = run(\n"
            "subprocess.CalledProcessError: Command 'ssh nohost2.invalid' returned non-zero exit status 255.\n"
            "[WARN] Node with rank 1 exited with code 255\n")
    assert run_ranks([sys.executable, "-c", f"import sys; sys.stderr.write({seen!r})"]) == 1
    err = capfd.readouterr().err
    assert "Traceback" not in err and "CalledProcessError" not in err, err
    assert err.count("edge0: error: a rank exited with code 255: ssh's own") == 1, err


def test_a_bad_flag_of_the_ranked_command_is_said_once_before_any_rank_starts():
    """Each rank parsed the command itself: its usage and error came once per rank, after mlx.launch started them."""
    got = subprocess.run([sys.executable, "-m", "edge0.cli", "launch", "-n", "2", "--", "run", "--max-tokens", "2",
                          "--no-such-flag"], capture_output=True, text=True, timeout=120)
    assert got.returncode == 2, got.stderr
    assert got.stderr.count("unrecognized arguments: --no-such-flag") == 1, got.stderr
    assert got.stderr.count("usage:") == 1 and "Traceback" not in got.stderr, got.stderr
