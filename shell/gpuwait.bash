# gpuwait shell hook for bash. In ~/.bashrc:  command -v gpuwait >/dev/null && eval "$(gpuwait shell-init bash)"
# The commands below run through gpuwait, which waits until their VRAM fits (default_vram,
# wrap_only_in and never_wrap in `gpuwait config` say how much, where and which).
# Bare run: `command python ...`, or GPUWAIT_DISABLE=1. Inside a gpuwait job nothing is wrapped.
if [[ -n "@ALWAYS@" || $- == *i* ]]; then
    # The job's gpuwait runs: its pid is there and, where the job says when that process
    # started (GPUWAIT_JOB_START), it is that process still. Once the job has ended, its pid
    # may be another process's (a server's pids come round again).
    __gpuwait_job_runs() {
        [[ -z "${GPUWAIT_JOB_PID-}" ]] && return 0
        [[ -n "${GPUWAIT_JOB_START-}" ]] || { [[ -e "/proc/${GPUWAIT_JOB_PID}" ]]; return; }
        local stat IFS=' '
        { read -r stat < "/proc/${GPUWAIT_JOB_PID}/stat"; } 2>/dev/null || return 1
        # After the name, which may hold spaces and ')': field 22 is the 20th.
        local -a fields=( ${stat##*') '} )
        [[ "${fields[19]-}" == "$GPUWAIT_JOB_START" ]]
    }
    __gpuwait_run() {
        # Stepping aside here costs no Python start-up; every other rule is in `shell-hook`.
        # `|| return` ends each way with the command's status as a failure the shell's ERR
        # trap (under set -E) and set -e take no note of here: they act once, on the line typed,
        # as for the command bare, not again for each of the hook's functions.
        # Inside a job, while it runs: a shell that outlived it (a tmux server started there)
        # keeps GPUWAIT_JOB_ID, and its commands would run bare on the ended job's GPUs.
        if { [[ -n "${GPUWAIT_JOB_ID-}" ]] && __gpuwait_job_runs; } || [[ -n "${GPUWAIT_DISABLE-}" && "${GPUWAIT_DISABLE-}" != 0 ]]; then
            command "$@" || return
        elif [[ -n "${COMP_LINE+set}${READLINE_LINE+set}" ]] || __gpuwait_from_prompt; then
            # Run by the shell on its own, not typed: by a completion (`python -m <Tab>` lists
            # modules with python), a key binding (bind -x) or PROMPT_COMMAND. Wrapped, it
            # would wait for a GPU.
            command "$@" || return
        elif [[ -x @PYTHON@ && -f @PACKAGE@ ]]; then
            # The pids in a variable, which an older gpuwait ignores, not an option it refuses.
            _GPUWAIT_SHELL_PID="$$/${BASHPID-$$}" @GPUWAIT@ shell-hook -- "$@" || return
        elif hash gpuwait 2>/dev/null; then
            # The gpuwait that printed this hook is gone (uninstalled, its environment removed
            # or replaced): the one on PATH, which a new shell would hook, takes its place.
            # (`hash` looks again: the path bash remembers for gpuwait may be the gone one.)
            _GPUWAIT_SHELL_PID="$$/${BASHPID-$$}" command gpuwait shell-hook -- "$@" || return
        else
            printf '%s\n' "gpuwait: the gpuwait this shell was hooked to is gone (uninstalled, or its environment removed) and none is on PATH: runs $1 bare" >&2
            command "$@" || return
        fi
    }
    if (( BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] >= 404 )); then
        # A line typed at the prompt stamps __gpuwait_typed as PS0 (bash 4.4 and later) is
        # shown, before it runs. bash's HISTCMD is one less while a command runs than while
        # the prompt is drawn, with the history on or off, so PROMPT_COMMAND (run before PS1,
        # where nothing has been typed yet or after the line has run) finds HISTCMD at the
        # stamp, and the line itself one below. Anything else is wrapped: a line run from the
        # editor (Ctrl-X Ctrl-E) shows no PS0 and adds to the history, and so does the prompt
        # after it, which bash cannot tell from it.
        __gpuwait_from_prompt() {
            [[ $- == *i* && -z "${BASH_EXECUTION_STRING+set}" && "${PS0-}" == *'[__gpuwait_typed=HISTCMD]'* ]] \
                && shopt -q promptvars \
                && [[ -z "${__gpuwait_typed-}" || "$HISTCMD" == "$__gpuwait_typed" ]]
        }
        if [[ $- == *i* && "${PS0-}" != *'[__gpuwait_typed=HISTCMD]'* ]]; then
            PS0='${__gpuwait_stamp[__gpuwait_typed=HISTCMD]+}'"${PS0-}"
        fi
    else
        __gpuwait_from_prompt() { return 1; }  # no PS0 to tell a typed line by
    fi
@FUNCTIONS@
fi
