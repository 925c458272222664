"""Malformed invocations, environment variables and config files: each answered at once with
one clear line (and a hint where one helps) and its documented exit code; never a traceback,
never a wait, never a trace left in the ledger."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.fixtures_sim import SIMJOB

# (argv, environment, user config text, site config text, exit code, words in the message)
Case = tuple[list[str], dict[str, str], str | None, str | None, int, str]

CASES: dict[str, Case] = {
    # -- the command line --
    "size with a bad unit": (["--vram", "6X", "true"], {}, None, None, 2, "not a size"),
    "empty size": (["--vram", "", "true"], {}, None, None, 2, "not a size"),
    # An exponent, as Python and JSON write numbers: "give a unit" pointed at the unit it has.
    "exponent size": (
        ["--vram", "1e3M", "true"],
        {},
        None,
        None,
        2,
        "gpuwait: error: --vram '1e3M' is not a size: it takes no exponent; write 1000M",
    ),
    # As a size with one is told: "not a duration" alone did not say what was wrong.
    "exponent duration": (
        ["--timeout", "1e3s", "true"],
        {},
        None,
        None,
        2,
        "gpuwait: error: --timeout '1e3s' is not a duration: it takes no exponent; write 1000s",
    ),
    "exponent duration without a unit": (
        ["--timeout", "1.5E2", "true"],
        {},
        None,
        None,
        2,
        "'1.5E2' is not a duration: it takes no exponent; write 150s",
    ),
    # "give a unit" pointed at the unit it has.
    "size with a point and no digits after it": (
        ["--vram", "6.G", "true"],
        {},
        None,
        None,
        2,
        "gpuwait: error: --vram '6.G' is not a size: a point needs digits after it; write 6G",
    ),
    "share with a point and no digits after it": (
        ["--vram", "50.%", "true"],
        {},
        None,
        None,
        2,
        "'50.%' is not a size: a point needs digits after it; write 50%",
    ),
    "duration with a point and no digits after it": (
        ["--timeout", "1.h", "true"],
        {},
        None,
        None,
        2,
        "'1.h' is not a duration: a point needs digits after it; write 1h",
    ),
    # Was "'1h30.m' gives 30 no unit; write 1h30.mm".
    "duration with a point and no digits after its second number": (
        ["--timeout", "1h30.m", "true"],
        {},
        None,
        None,
        2,
        "'1h30.m' is not a duration: a point needs digits after it; write 1h30m",
    ),
    # Was "'400.d' is not a duration; use e.g. 30s, ...": 400d is one too long to suggest.
    "duration with a point and no digits after it, too long": (
        ["--timeout", "400.d", "true"],
        {},
        None,
        None,
        2,
        "'400.d' is not a duration: a point needs digits after it, and it is too long (at "
        "most 365d)",
    ),
    # Was "'2000.T' is not a size; give a unit: ...", pointing at the unit it has.
    "size with a point and no digits after it, too large": (
        ["--vram", "2000.T", "true"],
        {},
        None,
        None,
        2,
        "'2000.T' is not a size: a point needs digits after it, and it is too large (at most "
        "1024T)",
    ),
    "share with a point and no digits after it, over 100%": (
        ["--vram", "150.%", "true"],
        {},
        None,
        None,
        2,
        "'150.%' is not a size: a point needs digits after it, and a percentage of a GPU must "
        "be above 0% and at most 100%",
    ),
    # Was "write 0G", which is refused in turn.
    "size with a point and no digits after it, zero": (
        ["--vram", "0.G", "true"],
        {},
        None,
        None,
        2,
        "'0.G' is not a size: a point needs digits after it, and a VRAM request must be "
        "larger than zero",
    ),
    "exponent size with a fraction": (
        ["--vram", "1.5E-1G", "true"],
        {},
        None,
        None,
        2,
        "'1.5E-1G' is not a size: it takes no exponent; write 0.15G",
    ),
    "exponent share": (
        ["--vram", "5e1%", "true"],
        {},
        None,
        None,
        2,
        "'5e1%' is not a size: it takes no exponent; write 50%",
    ),
    "exponent size without a unit": (
        ["--vram", "6e9", "true"],
        {},
        None,
        None,
        2,
        "'6e9' is not a size: it takes no exponent; write 6000000000 with a unit: 6G (GiB)",
    ),
    # Negative and written with an exponent: told to give the unit it has.
    "negative exponent size": (
        ["--vram=-1e3M", "true"],
        {},
        None,
        None,
        2,
        "gpuwait: error: --vram '-1e3M' is negative; give a size above zero, e.g. 6G",
    ),
    "negative exponent share": (
        ["--vram=-5e1%", "true"],
        {},
        None,
        None,
        2,
        "gpuwait: error: --vram '-5e1%' is negative; give a share above zero, e.g. 50%",
    ),
    # Its exponent written with thousands of leading zeros: Python's own words on its limit
    # for converting a number of so many digits came out ("--vram Exceeds the limit (4300
    # digits) for integer string conversion ... use sys.set_int_max_str_digits()"), not
    # gpuwait's, which quote the value (cut short on the screen).
    "exponent size with a padded exponent": (
        ["--vram", "1e" + "0" * 5000 + "3M", "true"],
        {},
        None,
        None,
        2,
        "gpuwait: error: --vram '1e000",
    ),
    # A decimal comma, as many locales write it: told to give the unit it has, no one would
    # see what to change.
    "decimal comma": (["--vram", "6,5G", "true"], {}, None, None, 2, "with a point: 6.5G"),
    # 1,000G: a thousand, or one? Neither is guessed (1.000G would ask for a thousandth).
    # "6 GiB" pasted from a page that set a non-breaking space in it: "give a unit", which it
    # has, and that the same line typed by hand is taken.
    "size with a non-breaking space": (
        ["--vram", "6\u00a0GiB", "true"],
        {},
        None,
        None,
        2,
        "--vram '6\\xa0GiB' is not a size; type the space in it again: it is a non-breaking",
    ),
    "thousands comma": (["--vram", "1,000G", "true"], {}, None, None, 2, "as 1000G"),
    "duration with a decimal comma": (
        ["--timeout", "1,5h", "true"],
        {},
        None,
        None,
        2,
        "write decimals with a point: 1.5h",
    ),
    "zero percent": (["--vram", "0%", "true"], {}, None, None, 2, "percentage"),
    # A number without a unit meant GiB to whoever typed it; taken as bytes it admitted a job
    # with no room at all.
    "size without a unit": (
        ["--vram", "6", "true"],
        {},
        None,
        None,
        2,
        "6G (GiB), 6GB, 6000M or 50%",
    ),
    "fraction without a unit": (["--vram", "0.5", "true"], {}, None, None, 2, "has no unit"),
    "env default vram without a unit": (
        ["true"],
        {"GPUWAIT_DEFAULT_VRAM": "8"},
        None,
        None,
        2,
        "GPUWAIT_DEFAULT_VRAM",
    ),
    "config default vram without a unit": (
        ["true"],
        {},
        "default_vram = 8\n",
        None,
        2,
        "give a unit: 6G (GiB)",
    ),
    "site vram limit without a unit": (
        ["true"],
        {},
        None,
        "user_max_vram = 48\n",
        2,
        "has no unit",
    ),
    "absurd size": (["--vram", "99999999T", "true"], {}, None, None, 2, "too large"),
    # A name read from a file with its newline: taken, it showed as 'train?' and --after train
    # or cancel train never found it.
    "name ending in a newline": (
        ["--vram", "1G", "--name", "train\n", "true"],
        {},
        None,
        None,
        2,
        "use up to 100 letters",
    ),
    "batch ending in a newline": (
        ["--vram", "1G", "--batch", "nightly\n", "true"],
        {},
        None,
        None,
        2,
        "use up to 100 letters",
    ),
    # A key read from a file with its newline: its runs were learned apart, shown as
    # 'train?', and `history --key train` or `estimate --key train` never found them.
    "key ending in a newline": (
        ["--vram", "1G", "--key", "train\n", "true"],
        {},
        None,
        None,
        2,
        "--key 'train\\n': a key is one line",
    ),
    # default_vram takes 'exclusive'; --vram does not, and "give a unit" pointed nowhere.
    "vram exclusive": (
        ["--vram", "exclusive", "true"],
        {},
        None,
        None,
        2,
        "--vram 'exclusive' is no size: a whole GPU is --exclusive",
    ),
    "negative gpus": (["--gpus", "-1", "true"], {}, None, None, 2, "at least 1"),
    "checkpoint signal without pausable": (
        ["--vram", "1G", "--checkpoint-signal", "USR2", "true"],
        {},
        None,
        None,
        2,
        "add --pausable",
    ),
    # SIGKILL and SIGSTOP by number, as by name: no job can catch them, so it could never be
    # asked, and the job's own checkpoint.install() would fail at its start.
    "uncatchable checkpoint signal by number": (
        ["--vram", "1G", "--pausable", "--checkpoint-signal", "9", "true"],
        {},
        None,
        None,
        2,
        "not a signal a job can catch",
    ),
    # One gpuwait does not pass on to its command: sent to gpuwait before a time limit
    # (Slurm's --signal=B:SIG@N), it never reached the job (WINCH, CHLD, CONT, URG), or ended
    # gpuwait itself and left the command running unwatched (IO, gpuwait's own wake-up).
    "checkpoint signal gpuwait never passes on": (
        ["--vram", "1G", "--pausable", "--checkpoint-signal", "WINCH", "true"],
        {},
        None,
        None,
        2,
        "--checkpoint-signal 'WINCH' is not a signal gpuwait passes on to its command",
    ),
    "checkpoint signal gpuwait takes for itself": (
        ["--vram", "1G", "--pausable", "--checkpoint-signal", "29", "true"],
        {},
        None,
        None,
        2,
        "--checkpoint-signal '29' is not a signal gpuwait passes on to its command",
    ),
    # A name Python does not know (kill -l's RTMIN+1, a misspelling) was called one that no
    # job can catch, which USR3 and RTMIN+1 are not said to be.
    "unknown checkpoint signal name": (
        ["--vram", "1G", "--pausable", "--checkpoint-signal", "USR3", "true"],
        {},
        None,
        None,
        2,
        "--checkpoint-signal 'USR3' is no signal's name; use e.g. USR1, USR2, TERM",
    ),
    # A three in another script was read as the digit: RTMIN+٣ was taken for RTMIN+3.
    "checkpoint signal with digits other than 0-9": (
        ["--vram", "1G", "--pausable", "--checkpoint-signal", "RTMIN+\u0663", "true"],
        {},
        None,
        None,
        2,
        "--checkpoint-signal 'RTMIN+\u0663' is no signal's name; use e.g. USR1, USR2, TERM",
    ),
    # `--checkpoint-signal "$SIG"` where $SIG came out empty meant USR1, as no option would;
    # an empty --timeout is refused.
    "empty checkpoint signal": (
        ["--vram", "1G", "--pausable", "--checkpoint-signal", "", "true"],
        {},
        None,
        None,
        2,
        "--checkpoint-signal '' is no signal's name; use e.g. USR1, USR2, TERM",
    ),
    "grace-kill without pausable": (
        ["--vram", "1G", "--grace-kill", "true"],
        {},
        None,
        None,
        2,
        "--grace-kill applies to --pausable jobs only",
    ),
    # `--after-ok "$PREV"` where $PREV came out empty: the job must not start at once as if
    # it depended on nothing.
    "empty after": (["--vram", "1G", "--after", "", "true"], {}, None, None, 2, "names no job"),
    # A script's first step, with no job before it: told how to write a dependency on none.
    "empty after-ok of a first step": (
        ["--vram", "1G", "--after-ok", "", "true"],
        {},
        None,
        None,
        2,
        "leave the option out where the job depends on none",
    ),
    "after-ok of commas": (
        ["--vram", "1G", "--after-ok", " , ", "true"],
        {},
        None,
        None,
        2,
        "--after-ok ' , ' names no job",
    ),
    # "100% of a GPU per GPU can never fit": a share is already one of each GPU.
    "whole share never fits": (
        ["--vram", "100%", "true"],
        {},
        None,
        None,
        3,
        "gpuwait: error: 100% of a GPU can never fit: the largest candidate",
    ),
    "more gpus than exist": (["--vram", "1G", "--gpus", "9", "true"], {}, None, None, 3, "only 2"),
    "negative timeout with =": (["--timeout=-5s", "true"], {}, None, None, 2, "is negative"),
    "timeout unit": (["--timeout", "10x", "true"], {}, None, None, 2, "not a duration"),
    # 1h30 read as an hour and 30 s gave up half an hour before the 1h30m meant.
    "timeout number after an hour": (
        ["--timeout", "1h30", "true"],
        {},
        None,
        None,
        2,
        "'1h30' gives 30 no unit; write 1h30m",
    ),
    "timeout number after a day": (
        ["--timeout", "1d 12", "true"],
        {},
        None,
        None,
        2,
        "'1d 12' gives 12 no unit; write 1d12h",
    ),
    "priority zero": (["--priority", "0", "true"], {}, None, None, 2, "priority"),
    "priority word": (["--priority", "high", "true"], {}, None, None, 2, "priority"),
    "safety zero": (["--safety", "0", "true"], {}, None, None, 2, "fraction"),
    "safety word": (["--safety", "abc", "true"], {}, None, None, 2, "safety"),
    "empty devices": (["--vram", "1G", "--devices", ",", "true"], {}, None, None, 2, "no GPU"),
    "unknown uuid": (["--vram", "1G", "--devices", "GPU-zz", "true"], {}, None, None, 2, "no GPU"),
    "empty pick": (["--pick", "", "true"], {}, None, None, 2, "best-fit"),
    # `--ledger "$LAB"` with $LAB empty: taken for no ledger_dir, it put the job in the user's
    # own ledger, where the jobs of the shared one the config names do not see it.
    "empty ledger over the config's": (
        ["--ledger", "", "--vram", "1G", "true"],
        {},
        'ledger_dir = "/srv/gpuwait-lab"\n',
        None,
        2,
        "--ledger '' names no directory",
    ),
    "empty timeout over the environment's": (
        ["--timeout", " ", "--vram", "1G", "true"],
        {"GPUWAIT_TIMEOUT": "10m"},
        None,
        None,
        2,
        "--timeout ' ' is empty",
    ),
    "missing ledger dir": (
        ["--ledger", "/nonexistent/gpuwait", "--vram", "1G", "true"],
        {},
        None,
        None,
        5,
        "does not exist",
    ),
    "ledger dir is a file": (
        ["--ledger", "/etc/passwd", "--vram", "1G", "true"],
        {},
        None,
        None,
        5,
        "not a directory",
    ),
    # Words other tools use for their queue (`why`, `queue`, `stop`): "command not found" alone.
    "why a job waits": (["why", "8b5d0d38"], {}, None, None, 127, "did you mean `gpuwait status`?"),
    "the queue": (["queue"], {}, None, None, 127, "did you mean `gpuwait status`?"),
    "stop a job": (["stop", "train"], {}, None, None, 127, "did you mean `gpuwait cancel`?"),
    # gpuwait's option after the `--` that ends them: "--vram: command not found" alone.
    "option after the dashes": (
        ["--", "--vram", "6G", "python3", "x.py"],
        {},
        None,
        None,
        127,
        "gpuwait: hint: --vram is gpuwait's option, after the -- that ends them: "
        "gpuwait ... --vram 6G -- python3 x.py",
    ),
    # Its value missing too: the hint took the command's first word for it, a line refused in
    # turn ("--vram 'python3' ..."); it gives the option's placeholder instead.
    "option after the dashes, no value": (
        ["--", "--vram", "python3", "x.py"],
        {},
        None,
        None,
        127,
        "gpuwait: hint: --vram is gpuwait's option, after the -- that ends them: "
        "gpuwait ... --vram SIZE -- python3 x.py",
    ),
    # Two `--`, the second taken for the command: "--: command not found" alone.
    "dashes twice": (
        ["--", "--", "python3", "x.py"],
        {},
        None,
        None,
        127,
        "gpuwait: hint: -- is typed twice, the second taken for the command: "
        "gpuwait ... -- python3 x.py",
    ),
    "flag after the dashes": (
        ["--vram", "1G", "--", "--exclusive=", "true"],
        {},
        None,
        None,
        127,
        "gpuwait: error: --exclusive=: command not found",
    ),
    "flag after the dashes, hint": (
        ["--", "-v", "true"],
        {},
        None,
        None,
        127,
        "gpuwait: hint: -v is gpuwait's option, after the -- that ends them: gpuwait ... -v -- true",
    ),
    # A short subcommand with two letters swapped, too far from it in letters for a hint.
    "log with two letters swapped": (["lgo"], {}, None, None, 127, "did you mean `gpuwait log`?"),
    # `gpuwait help`, as git and pip take it: "command not found" alone left no way on.
    "help as a word": (["help"], {}, None, None, 127, "did you mean `gpuwait --help`?"),
    "version as a word": (["version"], {}, None, None, 127, "did you mean `gpuwait --version`?"),
    # `--vram` pasted from a page or a chat that made its two dashes one long one: taken for
    # the command, "—vram: command not found", and nothing said of the option meant.
    "option typed with an em dash": (
        ["—vram", "1G", "python", "x.py"],
        {},
        None,
        None,
        127,
        "gpuwait: hint: did you mean --vram? (— is a long dash, as an editor or a chat writes --)",
    ),
    "option typed with an en dash": (
        ["–vram=1G", "true"],
        {},
        None,
        None,
        127,
        "did you mean --vram?",
    ),
    "missing script": (["--vram", "1G", "./no-such-script"], {}, None, None, 127, "no such file"),
    "directory as command": (["--vram", "1G", "/tmp"], {}, None, None, 126, "not executable"),
    "config option": (["config", "--bogus"], {}, None, None, 2, "unrecognized arguments"),
    "sim without action": (["sim"], {}, None, None, 2, "sim init FILE"),
    "sim init without path": (["sim", "init"], {}, None, None, 2, "required"),
    # `gpuwait sim init --force "$GPUWAIT_SIM"` with the variable not set in this shell: the
    # empty path was read as the working directory, "/home/a is not a plain file".
    "sim init with an empty path": (
        ["sim", "init", "--force", ""],
        {},
        None,
        None,
        2,
        "gpuwait: error: sim init: the file's path is empty",
    ),
    "status extra word": (["status", "extra"], {}, None, None, 2, "unrecognized arguments"),
    # A negative value is the option's value, refused with a reason (argparse alone would
    # take it for an unknown option and say the option "expected one argument").
    "negative vram": (["--vram", "-1G", "true"], {}, None, None, 2, "'-1G' is negative"),
    "negative share": (["--vram", "-5%", "true"], {}, None, None, 2, "'-5%' is negative"),
    # Zero with a sign is zero, not negative: told as zero is.
    # A GPU job of 6 KiB was taken and queued: a unit mistyped, 6G meant.
    "size under a mebibyte": (
        ["--vram", "6K", "true"],
        {},
        None,
        None,
        2,
        "gpuwait: error: --vram '6K' is under 1 MiB, less than any GPU job uses; did you mean 6G?",
    ),
    "default vram under a mebibyte": (
        ["true"],
        {"GPUWAIT_DEFAULT_VRAM": "512KB"},
        None,
        None,
        2,
        "'512KB' is under 1 MiB, less than any GPU job uses; did you mean 512GB?",
    ),
    "zero with a minus sign": (
        ["--vram", "-0", "true"],
        {},
        None,
        None,
        2,
        "gpuwait: error: --vram '-0': a VRAM request must be larger than zero",
    ),
    "zero gibibytes with a minus sign": (
        ["--vram", "-0G", "true"],
        {},
        None,
        None,
        2,
        "--vram '-0G': a VRAM request must be larger than zero",
    ),
    "zero seconds with a minus sign": (
        ["--vram", "1G", "true"],
        {"GPUWAIT_NVML_INTERVAL": "-0s"},
        None,
        None,
        2,
        "'-0s' is not valid for nvml_interval: expected a duration of at least 1ms",
    ),
    "zero share with a minus sign": (
        ["--vram", "-0.0%", "true"],
        {},
        None,
        None,
        2,
        "--vram '-0.0%': a percentage of a GPU must be above 0%",
    ),
    "negative timeout apart": (
        ["--timeout", "-1s", "true"],
        {},
        None,
        None,
        2,
        "'-1s' is negative",
    ),
    # -- environment variables --
    "env safety": (["true"], {"GPUWAIT_SAFETY": "2"}, None, None, 2, "GPUWAIT_SAFETY"),
    "env pick": (["true"], {"GPUWAIT_PICK": "fastest"}, None, None, 2, "GPUWAIT_PICK"),
    "env poll interval": (
        ["true"],
        {"GPUWAIT_POLL_INTERVAL": "-1s"},
        None,
        None,
        2,
        "GPUWAIT_POLL_INTERVAL",
    ),
    "env default vram": (["true"], {"GPUWAIT_DEFAULT_VRAM": "lots"}, None, None, 2, "not a size"),
    "env on_no_gpu": (["true"], {"GPUWAIT_ON_NO_GPU": "maybe"}, None, None, 2, "run, fail"),
    "env on_state_error": (
        ["true"],
        {"GPUWAIT_ON_STATE_ERROR": "ignore"},
        None,
        None,
        2,
        "fail, run",
    ),
    "env site-only limit": (
        ["true"],
        {"GPUWAIT_USER_MAX_GPUS": "4"},
        None,
        None,
        2,
        "only be set by an administrator",
    ),
    # How long a waiter waits for another user's job to step aside is no waiter's to cut: a
    # user's 1s had every job it asked step aside, a second apart, for one need.
    "env pause grace max": (
        ["true"],
        {"GPUWAIT_PAUSE_GRACE_MAX": "1s"},
        None,
        None,
        2,
        "pause_grace_max can only be set by an administrator",
    ),
    # Another file in every directory: a job started beside sim.toml and `gpuwait status` run
    # elsewhere saw two machines, or were told to create a second one.
    "env sim relative": (
        ["status"],
        {"GPUWAIT_SIM": "sim.toml"},
        None,
        None,
        2,
        f"expected an absolute path such as {Path.cwd() / 'sim.toml'} or ~/sim.toml",
    ),
    "config sim relative": (
        ["--vram", "1G", "true"],
        {"GPUWAIT_SIM": ""},
        'sim = "sims/4x80.toml"\n',
        None,
        2,
        "a relative one is another file in every working directory",
    ),
    # Numbers of more digits than int() converts: Python's "Exceeds the limit (4300 digits)
    # for integer string conversion" came out, in a traceback where the GPUs were read; now
    # gpuwait's own words, quoting the value (cut short on the screen).
    "inherited visible devices of thousands of digits": (
        ["--vram", "1G", "true"],
        {"CUDA_VISIBLE_DEVICES": "1" * 5000},
        None,
        None,
        3,
        "gpuwait: error: CUDA_VISIBLE_DEVICES='1111",
    ),
    "devices of thousands of digits": (
        ["--vram", "1G", "--devices", "1" * 5000, "true"],
        {},
        None,
        None,
        2,
        "gpuwait: error: --devices '1111",
    ),
    "checkpoint signal of thousands of digits": (
        ["--vram", "1G", "--pausable", "--checkpoint-signal", "1" * 5000, "true"],
        {},
        None,
        None,
        2,
        "gpuwait: error: --checkpoint-signal '1111",
    ),
    "config with a number of thousands of digits": (
        ["--vram", "1G", "true"],
        {},
        "priority = " + "1" * 5000 + "\n",
        None,
        2,
        "config.toml: damaged, a number too long to read; fix or remove it",
    ),
    # `--option=--`: argparse (before Python 3.13) took the value for the end of the options
    # and gave a list, which the option's check met in a traceback.
    "size of two dashes after =": (
        ["--vram=--", "true"],
        {},
        None,
        None,
        2,
        "gpuwait: error: --vram '--' is not a size",
    ),
    "name of two dashes after =": (
        ["--name=--", "--vram", "1G", "true"],
        {},
        None,
        None,
        2,
        "gpuwait: error: --name '--': use up to 100 letters",
    ),
    "event log job of two dashes after =": (
        ["log", "--job=--"],
        {},
        None,
        None,
        2,
        "no job matches -- in the event log",
    ),
    "env config is a directory": (["true"], {"GPUWAIT_CONFIG": "/tmp"}, None, None, 2, "directory"),
    # The root directory was taken as a state dir: root's gpuwait wrote its ledger, history
    # and event log loose in /, and another user's was refused writing there only later.
    "env state dir is the root directory": (
        ["status"],
        {"GPUWAIT_STATE_DIR": "/"},
        None,
        None,
        2,
        "GPUWAIT_STATE_DIR: '/' is not valid for state_dir: the root directory is no "
        "directory of gpuwait's; give one of its own, such as /srv/gpuwait or ~/gpuwait",
    ),
    "env ledger dir is the root directory": (
        ["--vram", "1G", "true"],
        {"GPUWAIT_LEDGER_DIR": "//"},
        None,
        None,
        2,
        "'//' is not valid for ledger_dir: the root directory is no directory of gpuwait's",
    ),
    "env state dir is the home directory": (
        ["--vram", "1G", "true"],
        {"GPUWAIT_STATE_DIR": "~"},
        None,
        None,
        2,
        "'~' is not valid for state_dir: your home directory is no directory of gpuwait's",
    ),
    "env state dir is in /proc": (
        ["status"],
        {"GPUWAIT_STATE_DIR": "/proc/self"},
        None,
        None,
        2,
        "'/proc/self' is not valid for state_dir: /proc is the kernel's, where no file is kept",
    ),
    # TOML writes a NUL as \u0000, which no path can hold: the first look at the directory
    # ended in a traceback ("ValueError: embedded null byte"), `config` and `status` too.
    "config state dir with a NUL": (
        ["--vram", "1G", "true"],
        {},
        'state_dir = "~/state\\u0000/gpuwait"\n',
        None,
        2,
        "'~/state\\x00/gpuwait' is not valid for state_dir: a path holds no NUL character",
    ),
    "config ledger dir with a NUL, status": (
        ["status"],
        {},
        'ledger_dir = "/srv/gpuwait\\u0000"\n',
        None,
        2,
        "is not valid for ledger_dir: a path holds no NUL character",
    ),
    "config sim with a NUL": (
        ["config"],
        {"GPUWAIT_SIM": ""},
        'sim = "/srv/\\u0000sim.toml"\n',
        None,
        2,
        "is not valid for sim: a path holds no NUL character",
    ),
    "env config missing": (
        ["true"],
        {"GPUWAIT_CONFIG": "/nonexistent/gpuwait.toml"},
        None,
        None,
        2,
        "does not exist",
    ),
    # A name no file can have (a component past 255 bytes; a directory shut to the user
    # alike): every command ended in a traceback from the check that the file exists.
    "env config name too long": (
        ["true"],
        {"GPUWAIT_CONFIG": "/tmp/" + "c" * 300 + "/gpuwait.toml"},
        None,
        None,
        2,
        "File name too long",
    ),
    # A home the path's ~ names that nobody has (`~nosuchuser/...`, a user's name mistyped):
    # every command ended in a traceback, "Could not determine home directory".
    "env config home unknown": (
        ["true"],
        {"GPUWAIT_CONFIG": "~gpuwait-no-such-user/gpuwait.toml"},
        None,
        None,
        2,
        "whose home directory is not known",
    ),
    # The same in the settings of other paths: they said "expected an absolute path", as if
    # the path were a relative one, not that its home is unknown.
    "env state dir home unknown": (
        ["true"],
        {"GPUWAIT_STATE_DIR": "~gpuwait-no-such-user/state"},
        None,
        None,
        2,
        "the home directory ~gpuwait-no-such-user is not known here",
    ),
    "env sim home unknown": (
        ["true"],
        {"GPUWAIT_SIM": "~gpuwait-no-such-user/sim.toml"},
        None,
        None,
        2,
        "the home directory ~gpuwait-no-such-user is not known here",
    ),
    "env sim missing": (
        ["--vram", "1G", "true"],
        {"GPUWAIT_SIM": "/nonexistent.toml", "GPUWAIT_ON_NO_GPU": "fail"},
        None,
        None,
        4,
        "not found",
    ),
    "env nvml timeout zero": (
        ["true"],
        {"GPUWAIT_NVML_TIMEOUT": "0"},
        None,
        None,
        2,
        "at least 1ms",
    ),
    "env sample interval too short": (
        ["true"],
        {"GPUWAIT_SAMPLE_INTERVAL": "0.5ms"},
        None,
        None,
        2,
        "at least 1ms",
    ),
    "env lock timeout word": (
        ["true"],
        {"GPUWAIT_LOCK_TIMEOUT": "forever"},
        None,
        None,
        2,
        "not a duration",
    ),
    # -- the user's config file --
    "config safety word": (["true"], {}, 'safety = "high"\n', None, 2, "not valid for safety"),
    "config sample interval a busy loop": (
        ["true"],
        {},
        "sample_interval = 1e-300\n",
        None,
        2,
        "at least 1ms",
    ),
    # `--all` shows every run: a count beside it was silently ignored.
    "history count with all": (
        ["history", "-n", "5", "--all"],
        {},
        None,
        None,
        2,
        "not allowed with argument -n",
    ),
    "config unknown key": (["true"], {}, "safty = 0.5\n", None, 2, "unknown setting 'safty'"),
    # A [gpuwait] table, as other tools' files have: the hint was "did you mean gpu_weights?".
    "config settings under a table": (
        ["true"],
        {},
        "[gpuwait]\nsafety = 0.8\n",
        None,
        2,
        "settings go at the top of the file: remove the [gpuwait] line",
    ),
    "config settings under a dotted table": (
        ["true"],
        {},
        "[tool.gpuwait]\nsafety = 0.8\n",
        None,
        2,
        "settings go at the top of the file: remove the [tool.gpuwait] line",
    ),
    # The memory options of other tools (Slurm's --mem and --mem-per-gpu): the hint named an
    # option close in letters alone, "did you mean --name?", "--gpu-name?", "--key?".
    "memory option of slurm": (["--mem", "6G", "true"], {}, None, None, 2, "did you mean --vram?"),
    "memory option, long": (["--memory", "6G", "true"], {}, None, None, 2, "did you mean --vram?"),
    "memory option per gpu": (
        ["--mem-per-gpu=6G", "true"],
        {},
        None,
        None,
        2,
        "did you mean --vram?",
    ),
    "gpu memory option": (["--gpu-mem", "6G", "true"], {}, None, None, 2, "did you mean --vram?"),
    # A size's unit typed as a word of its own: "'6' has no unit; give a unit", to one who did.
    "size with its unit apart": (
        ["--vram", "6", "GB", "python3", "x.py"],
        {},
        None,
        None,
        2,
        "gpuwait: hint: did you mean --vram 6GB? a size takes its unit in the same word",
    ),
    "share with its percent apart": (
        ["--vram", "50", "%", "true"],
        {},
        None,
        None,
        2,
        "did you mean --vram 50%?",
    ),
    # A duration's unit typed as a word of its own: "min: command not found" alone.
    "duration with its unit apart": (
        ["--vram", "1G", "--timeout", "30", "min", "python3", "x.py"],
        {},
        None,
        None,
        127,
        "gpuwait: hint: did you mean --timeout 30m? a duration takes its unit in the same word",
    ),
    "duration with its unit apart, hours": (
        ["--vram", "1G", "--timeout", "1.5", "hours", "true"],
        {},
        None,
        None,
        127,
        "did you mean --timeout 1.5h?",
    ),
    # One dash: it said "argument -v/--verbose: ignored explicit argument 'ram'".
    "option with one dash": (
        ["-vram", "6G", "true"],
        {},
        None,
        None,
        2,
        "-vram is no option: a long option takes two dashes",
    ),
    "option with one dash, hint": (
        ["-vram", "6G", "true"],
        {},
        None,
        None,
        2,
        "did you mean --vram?",
    ),
    # A flag with a long option glued on: it said "-vram is no option", a word not typed, and
    # "did you mean --vram?", which leaves -q out.
    "option glued to a flag": (
        ["-qvram", "4G", "true"],
        {},
        None,
        None,
        2,
        "-qvram is no option: a long option takes two dashes",
    ),
    "option glued to a flag, hint": (
        ["-qvram", "4G", "true"],
        {},
        None,
        None,
        2,
        "did you mean -q --vram?",
    ),
    "config site-only key": (["true"], {}, "user_max_gpus = 8\n", None, 2, "administrator"),
    "config pause grace max": (["true"], {}, 'pause_grace_max = "1s"\n', None, 2, "administrator"),
    "config list timeout": (["true"], {}, "timeout = [1, 2]\n", None, 2, "not a duration"),
    "config fractional priority": (["true"], {}, "priority = 3.7\n", None, 2, "priority"),
    "config binary": (["true"], {}, "\udcff\udcfe", None, 2, "not UTF-8"),
    "config zero default vram": (["true"], {}, "default_vram = 0\n", None, 2, "larger than zero"),
    "config number as process names": (
        ["true"],
        {},
        "ignore_processes = 5\n",
        None,
        2,
        "not valid for ignore_processes",
    ),
    "config nested process names": (
        ["true"],
        {},
        'ignore_processes = [["Xorg"]]\n',
        None,
        2,
        "list of strings",
    ),
    # -- the site config file --
    "site vram limit word": (["true"], {}, None, 'user_max_vram = "lots"\n', 2, "site config"),
    "site negative gpus": (["true"], {}, None, "user_max_gpus = -1\n", 2, "whole number"),
    "site half-life word": (
        ["true"],
        {},
        None,
        'fair_share_half_life = "soon"\n',
        2,
        "not a duration",
    ),
    "site broken toml": (["true"], {}, None, "user_max_gpus = \n", 2, "site config file"),
}


def test_there_are_at_least_thirty_cases() -> None:
    assert len(CASES) >= 30


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_answered_at_once(sim: Path, isolated_dirs: Path, name: str) -> None:
    argv, env, config, site, status, words = CASES[name]
    for text, where in ((config, "config"), (site, "site-config")):
        if text is not None:
            path = isolated_dirs / where / "gpuwait" / "config.toml"
            path.parent.mkdir(parents=True)
            path.write_bytes(text.encode("utf-8", "surrogateescape"))
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "gpuwait", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )
    assert done.returncode == status, done.stderr
    assert words in done.stderr, done.stderr
    assert done.stderr.startswith("gpuwait: error:"), done.stderr
    assert "Traceback" not in done.stderr
    # One line, and a hint line at most.
    assert len(done.stderr.splitlines()) <= 2, done.stderr
    assert time.monotonic() - started < 10
    ledger = isolated_dirs / "state" / "gpuwait" / "ledger.json"
    assert not ledger.exists() or json.loads(ledger.read_text())["jobs"] == []


def test_a_duration_with_its_unit_apart_is_never_offered_past_its_bound(sim: Path) -> None:
    # `--timeout 400 d` was answered "did you mean --timeout 400d?", a line refused in turn as
    # too long; a size with its unit apart past its bound (--vram 99999 T) is offered none.
    done = subprocess.run(
        [sys.executable, "-m", "gpuwait", "--vram", "1G", "--timeout", "400", "d", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 127, done.stderr
    assert done.stderr.splitlines() == [
        "gpuwait: error: d: command not found",
        "gpuwait: hint: --timeout takes its unit in the same word, and '400d' is too long "
        "(at most 365d)",
    ], done.stderr


@pytest.mark.parametrize("word", ["-qhvram", "-hqvram", "-hvram"])
def test_a_hint_never_gives_a_line_that_prints_help(sim: Path, word: str) -> None:
    # -qhvram 4G was answered "did you mean -qh --vram?": that line prints help and runs
    # nothing. The error still names the word; no hint is given.
    done = subprocess.run(
        [sys.executable, "-m", "gpuwait", word, "4G", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"gpuwait: error: {word} is no option: a long option takes two dashes; see 'gpuwait --help'"
    ], done.stderr


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["--wait", "10m", "true"], "gpuwait --help"),
        (["--size", "6G", "true"], "gpuwait --help"),
        (["estimate", "--mem", "6G", "--", "true"], "gpuwait estimate --help"),
    ],
)
def test_a_hint_never_names_an_option_alike_in_its_dashes_alone(
    sim: Path, argv: list[str], usage: str
) -> None:
    # --wait and --size were answered "did you mean --quiet?", estimate's --mem "did you mean
    # --key?": close to them in the two dashes every long option has, not in its name.
    done = subprocess.run(
        [sys.executable, "-m", "gpuwait", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    word = next(a for a in argv if a.startswith("--"))
    assert done.stderr.splitlines() == [
        f"gpuwait: error: unrecognized arguments: {word}; see '{usage}'"
    ], done.stderr


def test_world_writable_site_config_is_refused(sim: Path, isolated_dirs: Path) -> None:
    # In a directory with a space in its name: the hint's "chmod o-w /etc/my site/...", pasted,
    # changed /etc/my and failed on the rest; the path is quoted as the shell needs it now.
    site = isolated_dirs / "my site"
    path = site / "gpuwait" / "config.toml"
    path.parent.mkdir(parents=True)
    path.write_text("user_max_gpus = 1\n")
    path.chmod(0o666)
    done = subprocess.run(
        [sys.executable, "-m", "gpuwait", "--vram", "1G", "true"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "XDG_CONFIG_DIRS": str(site)},
    )
    assert done.returncode == 2 and "writable by every user" in done.stderr
    hint = done.stderr.splitlines()[-1]
    assert hint.startswith("gpuwait: hint: an administrator runs: chmod o-w "), done.stderr
    pasted = hint.removeprefix("gpuwait: hint: an administrator runs: ")
    subprocess.run(["sh", "-c", pasted], check=True, timeout=30)
    assert path.stat().st_mode & 0o777 == 0o664


@pytest.mark.parametrize(
    "argv", [["status"], ["config"], ["history"], ["completion", "bash"], ["--help"]]
)
def test_a_reader_that_went_away_ends_output_quietly(
    sim: Path, isolated_dirs: Path, argv: list[str]
) -> None:
    """`gpuwait status | true`, `| head -1`: no traceback, the status of a SIGPIPE death."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "gpuwait", *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr == ""
    assert done.returncode == 141


def test_a_simulated_job_refuses_a_size_without_a_unit(sim: Path) -> None:
    # The simulated CUDA program's own parser, answering in one line as gpuwait does.
    done = subprocess.run(
        [sys.executable, "-m", "gpuwait", "sim", "job", "--vram", "4"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "'4' has no unit; give a unit: 6G (GiB), 6GB or 6000M" in done.stderr


@pytest.mark.parametrize(("option", "value"), [("--ramp", "-1s"), ("--hold", "-.5s")])
def test_a_simulated_job_says_a_negative_duration_is_negative(
    sim: Path, option: str, value: str
) -> None:
    # `--ramp -1s` was "argument --ramp: expected one argument": the value taken for an option.
    done = subprocess.run(
        [sys.executable, "-m", "gpuwait", "sim", "job", "--vram", "1G", option, value],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.startswith(
        f"gpuwait sim job: error: argument {option}: {value!r} is negative; give a duration"
    ), done.stderr


def test_sim_init_force_replaces_only_a_plain_file(tmp_path: Path) -> None:
    # `--force` is for a simulation file; a device, a FIFO or a directory at the path is
    # something else (as root, /dev/null would have become a plain file).
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    folder = tmp_path / "folder"
    folder.mkdir()
    for path in (fifo, folder):
        done = subprocess.run(
            [sys.executable, "-m", "gpuwait", "sim", "init", "--force", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, done.stderr
        assert "not a plain file" in done.stderr and "Traceback" not in done.stderr
    assert fifo.is_fifo() and folder.is_dir()
    plain = tmp_path / "sim.toml"
    plain.write_text("old")
    done = subprocess.run(
        [sys.executable, "-m", "gpuwait", "sim", "init", "--force", str(plain)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "[[gpu]]" in plain.read_text()


def test_a_simulated_job_refuses_a_checkpoint_it_could_never_write(
    sim: Path, tmp_path: Path
) -> None:
    job = [sys.executable, "-m", "gpuwait", "sim", "job", "--vram", "1G", "--hold", "0s"]
    for path, said in ((tmp_path / "missing" / "ck", "does not exist"), (tmp_path, "directory")):
        done = subprocess.run(
            [*job, "--checkpoint", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, done.stderr
        assert said in done.stderr and "Traceback" not in done.stderr
        assert len(done.stderr.splitlines()) == 1


@pytest.mark.parametrize(
    "found",
    ["[" * 100_000 + "]" * 100_000, '{"held_seconds": 1e400}', '{"held_seconds": -1e9}'],
    ids=["nested", "infinite", "negative"],
)
def test_a_simulated_job_takes_a_damaged_checkpoint_for_none(
    sim: Path, tmp_path: Path, found: str
) -> None:
    # Its own file, damaged (or nested too deeply to read): the job starts over, holds its
    # memory as long as asked and ends, rather than a traceback, no hold at all, or years.
    checkpoint = tmp_path / "ck.json"
    checkpoint.write_text(found)
    started = time.monotonic()
    done = subprocess.run(
        [*SIMJOB, "--vram", "1G", "--hold", "1s", "--checkpoint", str(checkpoint)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert time.monotonic() - started >= 1
    assert json.loads(checkpoint.read_text()) == {
        "held_seconds": 1.0,
        "finished": True,
        "resumes": 0,
    }
