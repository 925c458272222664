# gpuwait shell hook for fish. In ~/.config/fish/config.fish:  command -q gpuwait; and gpuwait shell-init fish | source
# The commands below run through gpuwait, which waits until their VRAM fits (default_vram,
# wrap_only_in and never_wrap in `gpuwait config` say how much, where and which).
# Bare run: `command python ...`, or GPUWAIT_DISABLE=1. Inside a gpuwait job nothing is wrapped.
if test -n "@ALWAYS@"; or status is-interactive
    # The job's gpuwait runs: its pid is there and, where the job says when that process
    # started (GPUWAIT_JOB_START), it is that process still. Once the job has ended, its pid
    # may be another process's (a server's pids come round again).
    function __gpuwait_job_runs
        test -z "$GPUWAIT_JOB_PID"; and return 0
        if test -z "$GPUWAIT_JOB_START"
            test -e "/proc/$GPUWAIT_JOB_PID"
            return
        end
        test -r "/proc/$GPUWAIT_JOB_PID/stat"; or return 1
        read -l stat <"/proc/$GPUWAIT_JOB_PID/stat"; or return 1
        # After the name, which may hold spaces and ')': field 22 is the 20th.
        set -l fields (string split -n ' ' -- (string replace -r '^.*\) ' '' -- $stat))
        test (count $fields) -ge 20; and test "$fields[20]" = "$GPUWAIT_JOB_START"
    end
    function __gpuwait_run
        # Stepping aside here costs no Python start-up; every other rule is in `shell-hook`.
        # Inside a job, while it runs: a shell that outlived it (a tmux server started there)
        # keeps GPUWAIT_JOB_ID, and its commands would run bare on the ended job's GPUs.
        if test -n "$GPUWAIT_JOB_ID"; and __gpuwait_job_runs
            command $argv
        else if test -n "$GPUWAIT_DISABLE"; and test "$GPUWAIT_DISABLE" != 0
            command $argv
        else if status is-interactive; and set -l line (status current-commandline 2>/dev/null); and test -z "$line"
            # Run by the shell on its own, not typed (fish 3.6 and later tell): by a completion
            # (`python -m <Tab>` lists modules with python), the prompt, an event or a key
            # binding. Wrapped, it would wait for a GPU.
            command $argv
        else if test -x @PYTHON@; and test -f @PACKAGE@
            @GPUWAIT@ shell-hook -- $argv
        else if command -q gpuwait
            # The gpuwait that printed this hook is gone (uninstalled, its environment removed
            # or replaced): the one on PATH, which a new shell would hook, takes its place.
            command gpuwait shell-hook -- $argv
        else
            printf '%s\n' "gpuwait: the gpuwait this shell was hooked to is gone (uninstalled, or its environment removed) and none is on PATH: runs $argv[1] bare" >&2
            command $argv
        end
    end
    function __gpuwait_functions
@FUNCTIONS@
    end
    if status is-interactive; and functions -q __fish_on_interactive
        # fish's set-up at the first prompt is still to come. On a new account it reads the man
        # pages with python3 in the background; a function of that name runs in the foreground
        # (fish cannot put a function there), and the first prompt would wait for it. The
        # functions come after it, in the order fish calls the handlers of one event.
        function __gpuwait_functions_later --on-event fish_prompt --on-event fish_read
            functions -e __gpuwait_functions_later
            __gpuwait_functions
        end
    else
        __gpuwait_functions
    end
end
