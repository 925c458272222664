# gpuwait shell hook for fish. In ~/.config/fish/config.fish:  gpuwait shell-init fish | source
# The commands below run through gpuwait, which waits until their VRAM fits (default_vram,
# wrap_only_in and never_wrap in `gpuwait config` say how much, where and which).
# Bare run: `command python ...`, or GPUWAIT_DISABLE=1. Inside a gpuwait job nothing is wrapped.
if test -n "@ALWAYS@"; or status is-interactive
    function __gpuwait_run
        # Stepping aside here costs no Python start-up; every other rule is in `shell-hook`.
        # Inside a job, while it runs: a shell that outlived it (a tmux server started there)
        # keeps GPUWAIT_JOB_ID, and its commands would run bare on the ended job's GPUs.
        if test -n "$GPUWAIT_JOB_ID"; and begin; test -z "$GPUWAIT_JOB_PID"; or test -e "/proc/$GPUWAIT_JOB_PID"; end
            command $argv
        else if test -n "$GPUWAIT_DISABLE"; and test "$GPUWAIT_DISABLE" != 0
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
@FUNCTIONS@
end
