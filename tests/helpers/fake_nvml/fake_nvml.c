/*
 * A fake libnvidia-ml.so.1 for tests: real pynvml drives it through ctypes exactly as it
 * drives the NVIDIA driver, so the whole path from gpuwait down to the C ABI is exercised on
 * machines without a GPU.
 *
 * Build (tests/_fixtures_nvml.py does this):
 *   gcc -shared -fPIC -O1 -Wall -Wl,-soname,libnvidia-ml.so.1 -o libnvidia-ml.so.1 fake_nvml.c
 *
 * The machine is described by a text file named by the environment variable FAKE_NVML_STATE.
 * The file is read again on EVERY call, so a test changes the machine between two calls by
 * rewriting it (write a temporary file and rename it over, so no call sees half a file).
 * FAKE_NVML_STATE unset: a machine with no GPUs. Set but unreadable or malformed: every call
 * answers NVML_ERROR_UNKNOWN (999) and the reason goes to stderr, so a broken test setup is loud.
 *
 * One directive per line; '#' starts a comment; blank lines are ignored.
 *
 *   gpu <index> uuid=<text> name=<text> total=<bytes> used=<bytes>
 *       [reserved=<bytes>] [util=<pct|na>] [cc=<major>.<minor>|na] [mig=<0|1|na>]
 *       [mode=<0..3|na>] [grow=<n>]
 *       One GPU. Indices must be 0..N-1, each once (order of lines does not matter).
 *       In <text>, '_' stands for a space and %XX for any byte (%5F is a literal '_').
 *       Memory, as the driver reports it:
 *         v2 (nvmlDeviceGetMemoryInfo_v2): total, reserved, used, free = total - reserved - used
 *         v1 (nvmlDeviceGetMemoryInfo):    total, used = used + reserved, free = as in v2
 *       (v1 folds the driver's reservation into "used", as real drivers do.) used may exceed
 *       total, as from a confused driver: free is then reported as 0.
 *       util=na makes nvmlDeviceGetUtilizationRates answer NOT_SUPPORTED (3).
 *       cc=na makes nvmlDeviceGetCudaComputeCapability answer NOT_SUPPORTED (3). Defaults:
 *       mig: the current MIG mode nvmlDeviceGetMigMode reports (pending the same); na makes
 *       it answer NOT_SUPPORTED (3), as a GPU without MIG does.
 *       mode: what nvmlDeviceGetComputeMode reports (0 default, 1 exclusive thread,
 *       2 prohibited, 3 exclusive process); na makes it answer NOT_SUPPORTED (3). Default 0.
 *       grow: the first n process lists this process asks for with a buffer find more
 *       processes than the buffer holds (started between pynvml's two calls) and answer
 *       INSUFFICIENT_SIZE (7); later ones answer as usual. Default 0.
 *       reserved=0 util=0 cc=na mig=na; uuid defaults to GPU-fake-<index>, name to "Fake GPU".
 *   proc <gpu index> pid=<pid> mem=<bytes|na>
 *       A compute process on that GPU; mem=na is reported as 2^64-1 ("not available"), which
 *       pynvml turns into None.
 *   fail <gpu index|*> <function name> <nvml error code>
 *       That exported function answers the code for that GPU (or for every GPU with '*').
 *       Functions that take no GPU (nvmlInitWithFlags, nvmlDeviceGetCount_v2, ...) match '*'
 *       only. E.g. "fail 1 nvmlDeviceGetHandleByIndex_v2 15" (GPU 1 lost),
 *       "fail * nvmlDeviceGetMemoryInfo_v2 13" (an old driver without memory info v2).
 *   init_fail <nvml error code>
 *       Shorthand for "fail * nvmlInitWithFlags <code>" (nvmlInit and nvmlInit_v2 too).
 *   hang <gpu index|*> <function name> <seconds>
 *       That function sleeps this long before answering (as a wedged driver does), without
 *       holding the library's lock, so calls for other GPUs still answer meanwhile.
 *   driver <version>
 *       What nvmlSystemGetDriverVersion reports (default 999.99.99).
 *
 * As in the real library, calls before nvmlInitWithFlags (or after the matching number of
 * nvmlShutdown calls) answer UNINITIALIZED (1), and a handle whose GPU has left the state
 * file answers GPU_IS_LOST (15).
 *
 * If FAKE_NVML_LOG names a file, every call appends one line to it:
 *   <function> gpu=<index|-> ret=<code>[ count=<n>][ buf=null]
 * which lets tests check call protocols (the two-call process list, which memory version).
 *
 * Outside NVML's own API the library exports fakeNvmlReset(), which forgets the init count so
 * that one process can load the fake once and start every test from "not initialized".
 */

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int nvmlReturn_t;

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_GPU_IS_LOST 15
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25
#define NVML_ERROR_UNKNOWN 999

#define MAX_GPUS 64
#define MAX_PROCS 1024
#define MAX_FAILS 256
#define TEXT_LEN 128
#define LINE_LEN 1024

/* sizeof(nvmlMemory_v2_t) | 2 << 24, as in nvml.h and pynvml's nvmlMemory_v2 */
#define NVML_MEMORY_V2_VERSION ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24)))

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

typedef struct {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

/* Handles point into this array and stay valid for the life of the process; the GPU behind a
 * handle is looked up by index in the freshly read state on every call. */
typedef struct {
    int index;
} fake_device;
typedef fake_device *nvmlDevice_t;
static fake_device g_devices[MAX_GPUS];

typedef struct {
    int present;
    char uuid[TEXT_LEN];
    char name[TEXT_LEN];
    unsigned long long total, used, reserved;
    int util; /* -1: not supported */
    int cc_major, cc_minor; /* -1: not supported */
    int mig; /* -1: not supported, 0 disabled, 1 enabled */
    int mode; /* -1: not supported, else the NVML compute mode */
    int grow; /* process lists with a buffer that find the list grown past it */
} gpu_state;

typedef struct {
    int gpu;
    unsigned int pid;
    unsigned long long mem;
} proc_state;

typedef struct {
    int gpu; /* -1: every GPU */
    char func[TEXT_LEN];
    int code;
    double hang_s; /* > 0: a "hang" directive, not a failure */
} fail_state;

typedef struct {
    int ok; /* 0: the file could not be read or parsed; every call answers UNKNOWN */
    int gpu_count;
    gpu_state gpus[MAX_GPUS];
    int proc_count;
    proc_state procs[MAX_PROCS];
    int fail_count;
    fail_state fails[MAX_FAILS];
    char driver[TEXT_LEN];
} machine_state;

/* The state is large and read on every call; one static copy behind a lock keeps it off the
 * stack and keeps concurrent callers (pynvml is used from threads) from tearing it. */
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static machine_state g_state;
static int g_init_count;
/* Process lists per GPU that found the list grown (the "grow" field), in this process. */
static int g_grown[MAX_GPUS];

static void complain(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("fake_nvml: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

static int hexval(int c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* '_' -> ' ', %XX -> byte. Returns 0 on a bad escape or overflow. */
static int decode_text(const char *src, char *dst, size_t cap) {
    size_t n = 0;
    while (*src) {
        int c = (unsigned char)*src;
        if (c == '_') {
            c = ' ';
            src++;
        } else if (c == '%') {
            int hi = hexval((unsigned char)src[1]);
            int lo = hi < 0 ? -1 : hexval((unsigned char)src[2]);
            if (hi < 0 || lo < 0) return 0;
            c = hi * 16 + lo;
            src += 3;
        } else {
            src++;
        }
        if (n + 1 >= cap) return 0;
        dst[n++] = (char)c;
    }
    dst[n] = '\0';
    return 1;
}

static int parse_ull(const char *s, unsigned long long *out) {
    char *end;
    if (!*s || *s == '-') return 0;
    errno = 0;
    *out = strtoull(s, &end, 10);
    return errno == 0 && *end == '\0';
}

static int parse_int(const char *s, int *out) {
    char *end;
    long v;
    if (!*s) return 0;
    errno = 0;
    v = strtol(s, &end, 10);
    if (errno != 0 || *end != '\0' || v < -2147483647L || v > 2147483647L) return 0;
    *out = (int)v;
    return 1;
}

/* An integer from lo to hi, or "na" (not supported), stored as -1. */
static int parse_int_or_na(const char *s, int *out, int lo, int hi) {
    if (strcmp(s, "na") == 0) {
        *out = -1;
        return 1;
    }
    return parse_int(s, out) && *out >= lo && *out <= hi;
}

/* Splits "key=value"; returns the value or NULL when the token has another key. */
static const char *kv(const char *token, const char *key) {
    size_t n = strlen(key);
    if (strncmp(token, key, n) == 0 && token[n] == '=') return token + n + 1;
    return NULL;
}

static int parse_line(machine_state *st, char *line, int lineno) {
    char *tokens[16];
    int nt = 0;
    char *save = NULL;
    char *hash = strchr(line, '#');
    if (hash) *hash = '\0';
    for (char *t = strtok_r(line, " \t\r\n", &save); t; t = strtok_r(NULL, " \t\r\n", &save)) {
        if (nt == 16) {
            complain("line %d: too many fields", lineno);
            return 0;
        }
        tokens[nt++] = t;
    }
    if (nt == 0) return 1;

    if (strcmp(tokens[0], "gpu") == 0) {
        int idx;
        gpu_state *g;
        int have_total = 0, have_used = 0;
        if (nt < 2 || !parse_int(tokens[1], &idx) || idx < 0 || idx >= MAX_GPUS) {
            complain("line %d: gpu needs an index 0..%d", lineno, MAX_GPUS - 1);
            return 0;
        }
        g = &st->gpus[idx];
        if (g->present) {
            complain("line %d: gpu %d given twice", lineno, idx);
            return 0;
        }
        memset(g, 0, sizeof *g);
        g->present = 1;
        snprintf(g->uuid, sizeof g->uuid, "GPU-fake-%d", idx);
        snprintf(g->name, sizeof g->name, "Fake GPU");
        g->cc_major = g->cc_minor = -1;
        g->mig = -1;
        g->mode = 0;
        for (int i = 2; i < nt; i++) {
            const char *v;
            int ok;
            if ((v = kv(tokens[i], "uuid"))) {
                ok = decode_text(v, g->uuid, sizeof g->uuid);
            } else if ((v = kv(tokens[i], "name"))) {
                ok = decode_text(v, g->name, sizeof g->name);
            } else if ((v = kv(tokens[i], "total"))) {
                ok = parse_ull(v, &g->total);
                have_total = 1;
            } else if ((v = kv(tokens[i], "used"))) {
                ok = parse_ull(v, &g->used);
                have_used = 1;
            } else if ((v = kv(tokens[i], "reserved"))) {
                ok = parse_ull(v, &g->reserved);
            } else if ((v = kv(tokens[i], "cc"))) {
                if (strcmp(v, "na") == 0) {
                    g->cc_major = g->cc_minor = -1;
                    ok = 1;
                } else {
                    ok = sscanf(v, "%d.%d", &g->cc_major, &g->cc_minor) == 2 &&
                         g->cc_major >= 0 && g->cc_minor >= 0;
                }
            } else if ((v = kv(tokens[i], "mig"))) {
                ok = parse_int_or_na(v, &g->mig, 0, 1);
            } else if ((v = kv(tokens[i], "mode"))) {
                ok = parse_int_or_na(v, &g->mode, 0, 3);
            } else if ((v = kv(tokens[i], "util"))) {
                ok = parse_int_or_na(v, &g->util, 0, 100);
            } else if ((v = kv(tokens[i], "grow"))) {
                ok = parse_int(v, &g->grow) && g->grow >= 0;
            } else {
                ok = 0;
            }
            if (!ok) {
                complain("line %d: bad gpu field '%s'", lineno, tokens[i]);
                return 0;
            }
        }
        if (!have_total || !have_used) {
            complain("line %d: gpu %d needs total= and used=", lineno, idx);
            return 0;
        }
        return 1;
    }

    if (strcmp(tokens[0], "proc") == 0) {
        proc_state *p;
        int have_pid = 0, have_mem = 0;
        if (st->proc_count == MAX_PROCS) {
            complain("line %d: more than %d processes", lineno, MAX_PROCS);
            return 0;
        }
        p = &st->procs[st->proc_count];
        if (nt < 2 || !parse_int(tokens[1], &p->gpu) || p->gpu < 0 || p->gpu >= MAX_GPUS) {
            complain("line %d: proc needs a GPU index", lineno);
            return 0;
        }
        for (int i = 2; i < nt; i++) {
            const char *v;
            unsigned long long pid;
            int ok;
            if ((v = kv(tokens[i], "pid"))) {
                ok = parse_ull(v, &pid) && pid <= 0xffffffffULL;
                p->pid = (unsigned int)pid;
                have_pid = 1;
            } else if ((v = kv(tokens[i], "mem"))) {
                if (strcmp(v, "na") == 0) {
                    p->mem = ~0ULL;
                    ok = 1;
                } else {
                    ok = parse_ull(v, &p->mem);
                }
                have_mem = 1;
            } else {
                ok = 0;
            }
            if (!ok) {
                complain("line %d: bad proc field '%s'", lineno, tokens[i]);
                return 0;
            }
        }
        if (!have_pid || !have_mem) {
            complain("line %d: proc needs pid= and mem=", lineno);
            return 0;
        }
        st->proc_count++;
        return 1;
    }

    if (strcmp(tokens[0], "hang") == 0) {
        fail_state *f;
        char *end;
        if (nt != 4) {
            complain("line %d: hang <gpu|*> <function> <seconds>", lineno);
            return 0;
        }
        if (st->fail_count == MAX_FAILS) {
            complain("line %d: more than %d failures", lineno, MAX_FAILS);
            return 0;
        }
        f = &st->fails[st->fail_count];
        if (strcmp(tokens[1], "*") == 0) {
            f->gpu = -1;
        } else if (!parse_int(tokens[1], &f->gpu) || f->gpu < 0) {
            complain("line %d: bad GPU '%s'", lineno, tokens[1]);
            return 0;
        }
        errno = 0;
        f->hang_s = strtod(tokens[3], &end);
        if (strlen(tokens[2]) >= sizeof f->func || errno != 0 || *end != '\0' || !(f->hang_s > 0)) {
            complain("line %d: bad hang", lineno);
            return 0;
        }
        strcpy(f->func, tokens[2]);
        f->code = NVML_SUCCESS;
        st->fail_count++;
        return 1;
    }

    if (strcmp(tokens[0], "fail") == 0 || strcmp(tokens[0], "init_fail") == 0) {
        fail_state *f;
        const char *gpu_tok, *func_tok, *code_tok;
        if (st->fail_count == MAX_FAILS) {
            complain("line %d: more than %d failures", lineno, MAX_FAILS);
            return 0;
        }
        f = &st->fails[st->fail_count];
        if (tokens[0][0] == 'i') {
            if (nt != 2) {
                complain("line %d: init_fail <code>", lineno);
                return 0;
            }
            gpu_tok = "*";
            func_tok = "nvmlInitWithFlags";
            code_tok = tokens[1];
        } else {
            if (nt != 4) {
                complain("line %d: fail <gpu|*> <function> <code>", lineno);
                return 0;
            }
            gpu_tok = tokens[1];
            func_tok = tokens[2];
            code_tok = tokens[3];
        }
        if (strcmp(gpu_tok, "*") == 0) {
            f->gpu = -1;
        } else if (!parse_int(gpu_tok, &f->gpu) || f->gpu < 0) {
            complain("line %d: bad GPU '%s'", lineno, gpu_tok);
            return 0;
        }
        if (strlen(func_tok) >= sizeof f->func || !parse_int(code_tok, &f->code)) {
            complain("line %d: bad failure", lineno);
            return 0;
        }
        strcpy(f->func, func_tok);
        f->hang_s = 0;
        st->fail_count++;
        return 1;
    }

    if (strcmp(tokens[0], "driver") == 0 && nt == 2) {
        return decode_text(tokens[1], st->driver, sizeof st->driver);
    }

    complain("line %d: unknown directive '%s'", lineno, tokens[0]);
    return 0;
}

/* Fills g_state from the file; called with g_lock held at the start of every entry point. */
static void load_state(void) {
    machine_state *st = &g_state;
    const char *path = getenv("FAKE_NVML_STATE");
    char line[LINE_LEN];
    int lineno = 0;
    FILE *f;

    memset(st, 0, sizeof *st);
    strcpy(st->driver, "999.99.99");
    st->ok = 1;
    if (!path || !*path) return;
    f = fopen(path, "r");
    if (!f) {
        complain("cannot read FAKE_NVML_STATE=%s: %s", path, strerror(errno));
        st->ok = 0;
        return;
    }
    while (fgets(line, sizeof line, f)) {
        lineno++;
        if (!strchr(line, '\n') && !feof(f)) {
            complain("line %d: longer than %d bytes", lineno, LINE_LEN - 1);
            st->ok = 0;
            break;
        }
        if (!parse_line(st, line, lineno)) {
            st->ok = 0;
            break;
        }
    }
    fclose(f);
    if (!st->ok) return;
    for (int i = 0; i < MAX_GPUS; i++) {
        if (st->gpus[i].present) st->gpu_count = i + 1;
    }
    for (int i = 0; i < st->gpu_count; i++) {
        if (!st->gpus[i].present) {
            complain("GPU indices must be 0..N-1; %d is missing", i);
            st->ok = 0;
            return;
        }
    }
}

static void log_call(const char *func, int gpu, nvmlReturn_t ret, const char *extra) {
    const char *path = getenv("FAKE_NVML_LOG");
    FILE *f;
    if (!path || !*path) return;
    f = fopen(path, "a");
    if (!f) return;
    if (gpu >= 0)
        fprintf(f, "%s gpu=%d ret=%d%s\n", func, gpu, ret, extra ? extra : "");
    else
        fprintf(f, "%s gpu=- ret=%d%s\n", func, ret, extra ? extra : "");
    fclose(f);
}

/* The injected failure for (func, gpu), or SUCCESS. gpu < 0: a call that names no GPU. */
static nvmlReturn_t injected(const char *func, int gpu) {
    for (int i = 0; i < g_state.fail_count; i++) {
        const fail_state *f = &g_state.fails[i];
        if (f->hang_s > 0 || strcmp(f->func, func) != 0) continue;
        if (f->gpu == -1 || f->gpu == gpu) return f->code;
    }
    return NVML_SUCCESS;
}

/* Seconds the call (func, gpu) must hang for, or 0. */
static double hang_for(const char *func, int gpu) {
    for (int i = 0; i < g_state.fail_count; i++) {
        const fail_state *f = &g_state.fails[i];
        if (f->hang_s <= 0 || strcmp(f->func, func) != 0) continue;
        if (f->gpu == -1 || f->gpu == gpu) return f->hang_s;
    }
    return 0;
}

static void sleep_seconds(double seconds) {
    struct timespec left;
    left.tv_sec = (time_t)seconds;
    left.tv_nsec = (long)((seconds - (double)left.tv_sec) * 1e9);
    while (nanosleep(&left, &left) != 0 && errno == EINTR) {
    }
}

/* Common start of a call: lock, read the state, check init and injected failures.
 * Returns SUCCESS to carry on; anything else is the call's answer (lock already released). */
static nvmlReturn_t enter(const char *func, int gpu, int needs_init) {
    nvmlReturn_t ret;
    double hang;
    pthread_mutex_lock(&g_lock);
    load_state();
    hang = g_state.ok ? hang_for(func, gpu) : 0;
    if (hang > 0) {
        log_call(func, gpu, -1, " hang");
        pthread_mutex_unlock(&g_lock);
        sleep_seconds(hang);
        pthread_mutex_lock(&g_lock);
        load_state();
    }
    if (!g_state.ok) {
        ret = NVML_ERROR_UNKNOWN;
    } else if (needs_init && g_init_count == 0) {
        ret = NVML_ERROR_UNINITIALIZED;
    } else {
        ret = injected(func, gpu);
    }
    if (ret != NVML_SUCCESS) {
        log_call(func, gpu, ret, NULL);
        pthread_mutex_unlock(&g_lock);
    }
    return ret;
}

static nvmlReturn_t leave(const char *func, int gpu, nvmlReturn_t ret, const char *extra) {
    log_call(func, gpu, ret, extra);
    pthread_mutex_unlock(&g_lock);
    return ret;
}

/* Free memory as the driver reports it; a confused driver (used > total) reports none. */
static unsigned long long free_of(const gpu_state *g) {
    return g->used + g->reserved > g->total ? 0 : g->total - g->used - g->reserved;
}

/* The GPU behind a handle, as the state file describes it right now. */
static const gpu_state *device_state(nvmlDevice_t device) {
    if (device < g_devices || device >= g_devices + MAX_GPUS) return NULL;
    if (device->index >= g_state.gpu_count) return NULL;
    return &g_state.gpus[device->index];
}

static int device_index(nvmlDevice_t device) {
    if (device < g_devices || device >= g_devices + MAX_GPUS) return -1;
    return device->index;
}

static nvmlReturn_t copy_text(const char *src, char *dst, unsigned int length) {
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(dst, src);
    return NVML_SUCCESS;
}

/* ---- Exported NVML API -------------------------------------------------------------------- */

static nvmlReturn_t do_init(const char *func) {
    nvmlReturn_t ret = enter(func, -1, 0);
    if (ret != NVML_SUCCESS) return ret;
    g_init_count++;
    return leave(func, -1, NVML_SUCCESS, NULL);
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    return do_init("nvmlInitWithFlags");
}

nvmlReturn_t nvmlInit_v2(void) {
    return do_init("nvmlInitWithFlags");
}

nvmlReturn_t nvmlInit(void) {
    return do_init("nvmlInitWithFlags");
}

nvmlReturn_t nvmlShutdown(void) {
    nvmlReturn_t ret = enter("nvmlShutdown", -1, 1);
    if (ret != NVML_SUCCESS) return ret;
    g_init_count--;
    return leave("nvmlShutdown", -1, NVML_SUCCESS, NULL);
}

void fakeNvmlReset(void) {
    pthread_mutex_lock(&g_lock);
    g_init_count = 0;
    memset(g_grown, 0, sizeof g_grown);
    pthread_mutex_unlock(&g_lock);
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 5: return "Already Initialized";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 9: return "Driver Not Loaded";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 15: return "GPU is lost";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    case 25: return "Argument version mismatch";
    case 999: return "Unknown Error";
    default: return "Fake NVML error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    nvmlReturn_t ret = enter("nvmlSystemGetDriverVersion", -1, 1);
    if (ret != NVML_SUCCESS) return ret;
    return leave("nvmlSystemGetDriverVersion", -1, copy_text(g_state.driver, version, length),
                 NULL);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    nvmlReturn_t ret = enter("nvmlSystemGetNVMLVersion", -1, 1);
    if (ret != NVML_SUCCESS) return ret;
    return leave("nvmlSystemGetNVMLVersion", -1, copy_text("12.999.99", version, length), NULL);
}

static nvmlReturn_t do_count(const char *func, unsigned int *count) {
    nvmlReturn_t ret = enter(func, -1, 1);
    if (ret != NVML_SUCCESS) return ret;
    if (!count) return leave(func, -1, NVML_ERROR_INVALID_ARGUMENT, NULL);
    *count = (unsigned int)g_state.gpu_count;
    return leave(func, -1, NVML_SUCCESS, NULL);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    return do_count("nvmlDeviceGetCount_v2", count);
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) {
    return do_count("nvmlDeviceGetCount", count);
}

static nvmlReturn_t do_handle(const char *func, unsigned int index, nvmlDevice_t *device) {
    int gpu = index < MAX_GPUS ? (int)index : -1;
    nvmlReturn_t ret = enter(func, gpu, 1);
    if (ret != NVML_SUCCESS) return ret;
    if (!device || gpu < 0 || gpu >= g_state.gpu_count)
        return leave(func, gpu, NVML_ERROR_INVALID_ARGUMENT, NULL);
    g_devices[gpu].index = gpu;
    *device = &g_devices[gpu];
    return leave(func, gpu, NVML_SUCCESS, NULL);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    return do_handle("nvmlDeviceGetHandleByIndex_v2", index, device);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    return do_handle("nvmlDeviceGetHandleByIndex", index, device);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    const char *func = "nvmlDeviceGetHandleByUUID";
    int gpu = -1;
    nvmlReturn_t ret;
    /* Which GPU the UUID names is read before the call proper, so that "fail" and "hang"
     * directives for that GPU's index apply. */
    pthread_mutex_lock(&g_lock);
    load_state();
    for (int i = 0; uuid && g_state.ok && i < g_state.gpu_count; i++) {
        if (g_state.gpus[i].present && strcmp(g_state.gpus[i].uuid, uuid) == 0) gpu = i;
    }
    pthread_mutex_unlock(&g_lock);
    ret = enter(func, gpu, 1);
    if (ret != NVML_SUCCESS) return ret;
    if (!device || !uuid) return leave(func, gpu, NVML_ERROR_INVALID_ARGUMENT, NULL);
    if (gpu < 0 || gpu >= g_state.gpu_count) return leave(func, gpu, NVML_ERROR_NOT_FOUND, NULL);
    g_devices[gpu].index = gpu;
    *device = &g_devices[gpu];
    return leave(func, gpu, NVML_SUCCESS, NULL);
}

/* Starts a per-device call: the GPU's state, or an answer in *ret (lock released). A handle
 * whose GPU has left the state file answers GPU_IS_LOST, as a GPU that fell off the bus does. */
static const gpu_state *enter_device(const char *func, nvmlDevice_t device, nvmlReturn_t *ret) {
    int gpu = device_index(device);
    const gpu_state *g;
    *ret = enter(func, gpu, 1);
    if (*ret != NVML_SUCCESS) return NULL;
    if (gpu < 0) {
        *ret = leave(func, gpu, NVML_ERROR_INVALID_ARGUMENT, NULL);
        return NULL;
    }
    g = device_state(device);
    if (!g) {
        *ret = leave(func, gpu, NVML_ERROR_GPU_IS_LOST, NULL);
        return NULL;
    }
    return g;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    nvmlReturn_t ret;
    const gpu_state *g = enter_device("nvmlDeviceGetName", device, &ret);
    if (!g) return ret;
    return leave("nvmlDeviceGetName", device->index, copy_text(g->name, name, length), NULL);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    nvmlReturn_t ret;
    const gpu_state *g = enter_device("nvmlDeviceGetUUID", device, &ret);
    if (!g) return ret;
    return leave("nvmlDeviceGetUUID", device->index, copy_text(g->uuid, uuid, length), NULL);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    nvmlReturn_t ret;
    const gpu_state *g = enter_device("nvmlDeviceGetMemoryInfo", device, &ret);
    if (!g) return ret;
    if (!memory)
        return leave("nvmlDeviceGetMemoryInfo", device->index, NVML_ERROR_INVALID_ARGUMENT, NULL);
    memory->total = g->total;
    memory->used = g->used + g->reserved;
    memory->free = free_of(g);
    return leave("nvmlDeviceGetMemoryInfo", device->index, NVML_SUCCESS, NULL);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    nvmlReturn_t ret;
    const gpu_state *g = enter_device("nvmlDeviceGetMemoryInfo_v2", device, &ret);
    if (!g) return ret;
    if (!memory)
        return leave("nvmlDeviceGetMemoryInfo_v2", device->index, NVML_ERROR_INVALID_ARGUMENT,
                     NULL);
    if (memory->version != NVML_MEMORY_V2_VERSION)
        return leave("nvmlDeviceGetMemoryInfo_v2", device->index,
                     NVML_ERROR_ARGUMENT_VERSION_MISMATCH, NULL);
    memory->total = g->total;
    memory->reserved = g->reserved;
    memory->used = g->used;
    memory->free = free_of(g);
    return leave("nvmlDeviceGetMemoryInfo_v2", device->index, NVML_SUCCESS, NULL);
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
    nvmlReturn_t ret;
    const gpu_state *g = enter_device("nvmlDeviceGetUtilizationRates", device, &ret);
    if (!g) return ret;
    if (!utilization)
        return leave("nvmlDeviceGetUtilizationRates", device->index, NVML_ERROR_INVALID_ARGUMENT,
                     NULL);
    if (g->util < 0)
        return leave("nvmlDeviceGetUtilizationRates", device->index, NVML_ERROR_NOT_SUPPORTED,
                     NULL);
    utilization->gpu = (unsigned int)g->util;
    utilization->memory = (unsigned int)g->util;
    return leave("nvmlDeviceGetUtilizationRates", device->index, NVML_SUCCESS, NULL);
}

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor) {
    nvmlReturn_t ret;
    const gpu_state *g = enter_device("nvmlDeviceGetCudaComputeCapability", device, &ret);
    if (!g) return ret;
    if (!major || !minor)
        return leave("nvmlDeviceGetCudaComputeCapability", device->index,
                     NVML_ERROR_INVALID_ARGUMENT, NULL);
    if (g->cc_major < 0)
        return leave("nvmlDeviceGetCudaComputeCapability", device->index,
                     NVML_ERROR_NOT_SUPPORTED, NULL);
    *major = g->cc_major;
    *minor = g->cc_minor;
    return leave("nvmlDeviceGetCudaComputeCapability", device->index, NVML_SUCCESS, NULL);
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current,
                                  unsigned int *pending) {
    nvmlReturn_t ret;
    const gpu_state *g = enter_device("nvmlDeviceGetMigMode", device, &ret);
    if (!g) return ret;
    if (!current || !pending)
        return leave("nvmlDeviceGetMigMode", device->index, NVML_ERROR_INVALID_ARGUMENT, NULL);
    if (g->mig < 0)
        return leave("nvmlDeviceGetMigMode", device->index, NVML_ERROR_NOT_SUPPORTED, NULL);
    *current = *pending = (unsigned int)g->mig;
    return leave("nvmlDeviceGetMigMode", device->index, NVML_SUCCESS, NULL);
}

nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t device, int *mode) {
    nvmlReturn_t ret;
    const gpu_state *g = enter_device("nvmlDeviceGetComputeMode", device, &ret);
    if (!g) return ret;
    if (!mode)
        return leave("nvmlDeviceGetComputeMode", device->index, NVML_ERROR_INVALID_ARGUMENT, NULL);
    if (g->mode < 0)
        return leave("nvmlDeviceGetComputeMode", device->index, NVML_ERROR_NOT_SUPPORTED, NULL);
    *mode = g->mode;
    return leave("nvmlDeviceGetComputeMode", device->index, NVML_SUCCESS, NULL);
}

/* NVML's two-call protocol: with *infoCount too small (the first call passes 0 and NULL),
 * answer INSUFFICIENT_SIZE and the needed count; SUCCESS with count 0 means no processes. */
static nvmlReturn_t do_processes(const char *func, nvmlDevice_t device, unsigned int *infoCount,
                                 nvmlProcessInfo_t *infos) {
    nvmlReturn_t ret;
    char extra[64];
    unsigned int n = 0, asked;
    const gpu_state *g = enter_device(func, device, &ret);
    if (!g) return ret;
    if (!infoCount) return leave(func, device->index, NVML_ERROR_INVALID_ARGUMENT, NULL);
    asked = *infoCount;
    snprintf(extra, sizeof extra, " count=%u%s", asked, infos ? "" : " buf=null");
    for (int i = 0; i < g_state.proc_count; i++) {
        if (g_state.procs[i].gpu == device->index) n++;
    }
    if (n == 0) {
        *infoCount = 0;
        return leave(func, device->index, NVML_SUCCESS, extra);
    }
    if (asked < n || !infos) {
        *infoCount = n;
        return leave(func, device->index, NVML_ERROR_INSUFFICIENT_SIZE, extra);
    }
    if (g_grown[device->index] < g->grow) {
        g_grown[device->index]++;
        *infoCount = asked + 1;
        return leave(func, device->index, NVML_ERROR_INSUFFICIENT_SIZE, extra);
    }
    n = 0;
    for (int i = 0; i < g_state.proc_count; i++) {
        const proc_state *p = &g_state.procs[i];
        if (p->gpu != device->index) continue;
        infos[n].pid = p->pid;
        infos[n].usedGpuMemory = p->mem;
        /* 0xFFFFFFFF: not a MIG instance */
        infos[n].gpuInstanceId = 0xFFFFFFFFu;
        infos[n].computeInstanceId = 0xFFFFFFFFu;
        n++;
    }
    *infoCount = n;
    return leave(func, device->index, NVML_SUCCESS, extra);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_t *infos) {
    return do_processes("nvmlDeviceGetComputeRunningProcesses_v3", device, infoCount, infos);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_t *infos) {
    return do_processes("nvmlDeviceGetComputeRunningProcesses_v2", device, infoCount, infos);
}
