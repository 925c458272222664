# gpuwait shell hook for zsh. In ~/.zshrc (after compinit):  command -v gpuwait >/dev/null && eval "$(gpuwait shell-init zsh)"
# The commands below run through gpuwait, which waits until their VRAM fits (default_vram,
# wrap_only_in and never_wrap in `gpuwait config` say how much, where and which).
# Bare run: `command python ...`, or GPUWAIT_DISABLE=1. Inside a gpuwait job nothing is wrapped.
if [[ -n "@ALWAYS@" ]] || [[ -o interactive ]]; then
    # The job's gpuwait runs: its pid is there and, where the job says when that process
    # started (GPUWAIT_JOB_START), it is that process still. Once the job has ended, its pid
    # may be another process's (a server's pids come round again).
    __gpuwait_job_runs() {
        emulate -L zsh
        [[ -z "${GPUWAIT_JOB_PID-}" ]] && return 0
        [[ -n "${GPUWAIT_JOB_START-}" ]] || { [[ -e "/proc/${GPUWAIT_JOB_PID}" ]]; return }
        local stat
        { read -r stat < "/proc/${GPUWAIT_JOB_PID}/stat" } 2>/dev/null || return 1
        # After the name, which may hold spaces and ')': field 22 is the 20th.
        local -a fields
        fields=( ${=${stat##*\) }} )
        [[ "${fields[20]-}" == "$GPUWAIT_JOB_START" ]]
    }
    __gpuwait_run() {
        # Stepping aside here costs no Python start-up; every other rule is in `shell-hook`.
        # Inside a job, while it runs: a shell that outlived it (a tmux server started there)
        # keeps GPUWAIT_JOB_ID, and its commands would run bare on the ended job's GPUs.
        if { [[ -n "${GPUWAIT_JOB_ID-}" ]] && __gpuwait_job_runs } || [[ -n "${GPUWAIT_DISABLE-}" && "${GPUWAIT_DISABLE-}" != 0 ]]; then
            command "$@"
        elif [[ -o interactive && ( ${ZSH_EVAL_CONTEXT%%:*} == shfunc || ${ZSH_EVAL_CONTEXT%%:*} == cmdsubst ) ]]; then
            # Run by the shell on its own, not typed: by a completion (`python -m <Tab>` lists
            # modules with python), a widget, a hook (precmd, chpwd) or the prompt. Wrapped, it
            # would wait for a GPU.
            command "$@"
        elif [[ -x @PYTHON@ && -f @PACKAGE@ ]]; then
            # In a variable, which an older gpuwait ignores, not an option it would refuse;
            # taken here: in an assignment before a command, zsh has forked it already.
            local __gpuwait_pids="$$/${sysparams[pid]-$$}"
            _GPUWAIT_SHELL_PID=$__gpuwait_pids @GPUWAIT@ shell-hook -- "$@"
        elif whence -p gpuwait >/dev/null; then
            # The gpuwait that printed this hook is gone (uninstalled, its environment removed
            # or replaced): the one on PATH, which a new shell would hook, takes its place.
            local __gpuwait_pids="$$/${sysparams[pid]-$$}"
            _GPUWAIT_SHELL_PID=$__gpuwait_pids command gpuwait shell-hook -- "$@"
        else
            printf '%s\n' "gpuwait: the gpuwait this shell was hooked to is gone (uninstalled, or its environment removed) and none is on PATH: runs $1 bare" >&2
            command "$@"
        fi
    }
    # The pid of the (sub)shell that runs a function: `kill $!` ends a wrapped job put in the
    # background as it would end the command bare.
    zmodload -F zsh/system p:sysparams 2>/dev/null
@FUNCTIONS@
fi
