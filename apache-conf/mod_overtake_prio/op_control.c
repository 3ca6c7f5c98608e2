/*
 * op_control.c -- the control file (OvertakeControlFile FILE): the age thresholds the sidecar's
 * policy chose, applied without an edit of Apache's config or a restart. The sidecar
 * (controller/control_file.py) rewrites FILE in place whenever its policy changes (start-up,
 * online refit, PUT /-/policy); layout and check in oc_table.h.
 *
 * A request start glances at the file every OC_GLANCE_US, or when another child published a new
 * generation: it loads the file's generation word from this child's mapping (one guarded
 * load); only when it changed, or once a second (a file removed or replaced), is the file copied
 * out under the seqlock, checked (magic, sizes, stage and level counts, thresholds, and the MAC
 * of FILE.key so that only a sidecar holding the key can steer Apache) and its row 0 put in force,
 * with its stage section's count table (op_stage.c) when it has one.
 * A file that is absent, invalid, or shrinks under the mapping (SIGBUS, turned into a failed load
 * by og_fault.h) puts the configured OvertakePrioLevels back in force; each change of state is
 * logged once for the whole server.
 *
 * og_fault.h's state is static, one copy per file that includes it: every guarded load from the
 * control file is made here (the handlers of op_gate.c and this file chain).
 */
#include "mod_overtake_prio.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "apr_strings.h"
#include "http_protocol.h"
#include "http_request.h"

#include "og_fault.h"
#include "oc_table.h"

#define OC_LOOK_NS 1000000000   /* a path that gave no usable file is looked at once a second */
#define OC_RETAINED_KEY "mod_overtake_prio_control_v2"  /* v2: published */
/* a request start looks at the file at most this often (microseconds of its request_time), or
 * when another child published a change */
#define OC_GLANCE_US 10000

/* Shared by every child (anonymous shared memory of the parent, kept across graceful restarts). */
typedef struct {
    uint64_t said;              /* the state last logged: status << 32 | generation */
    apr_uint64_t loads;         /* tables put in force */
    apr_uint64_t refusals;      /* files refused (the configured thresholds apply) */
    apr_uint64_t faults;        /* loads that found the file shrunk under the mapping */
    uint32_t published;         /* bumped by a child that put another generation in force */
} oc_shared;

static oc_shared *oc_shm;
static og_hmac_key control_mac; /* FILE.key's pad states, read by the root parent */
static int control_key_loaded;

static struct {
    pthread_mutex_t mu;         /* guards everything below but the atomics */
    const uint8_t *map;         /* OC_FILE_MAX_BYTES of the file (atomic), never unmapped */
    dev_t dev;
    ino_t ino;
    uint32_t seen;              /* the generation last judged (atomic) */
    int64_t next_look;          /* monotonic ns: look at the path again (atomic) */
    uint32_t generation;        /* the generation of the file accepted last, 0: none (refused) */
    int from_file;              /* its thresholds are in force (else the configured ones) */
    int64_t conf_thr[OP_MAX_LEVELS];
    server_rec *s;
    oc_table tab;
    int judged;                 /* the file was judged once in this child (atomic) */
} ctl = {PTHREAD_MUTEX_INITIALIZER, NULL, 0, 0, 1u, 0, 0, 0, {0}, NULL, {0, 0, 0, {{0, {0}}}, 0, {0}}, 0};
/* the copy of the file a reload checks (under ctl.mu); untouched pages stay unallocated */
static uint8_t ctl_buf[OC_FILE_MAX_BYTES];
static size_t ctl_len;          /* the size of the file accepted last (under ctl.mu) */

/* n bytes from the mapping at src into dst; 0 if a page is gone (the file shrank). */
static int guarded_copy(void *dst, const void *src, size_t n)
{
    sigjmp_buf jb;
    if (sigsetjmp(jb, 0)) {
        return 0;
    }
    og_fault_jmp = &jb;
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    memcpy(dst, src, n);
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    og_fault_jmp = NULL;
    return 1;
}

/* Log the state (status, generation) once for the server: the first child to reach it says it. */
static void say(int status, uint32_t gen, int err, const char *why)
{
    uint64_t key = (uint64_t)(uint32_t)status << 32 | gen;
    char thr[OP_MAX_LEVELS * 16];
    int k, n = 0;
    if (!oc_shm || __atomic_exchange_n(&oc_shm->said, key, __ATOMIC_ACQ_REL) == key) {
        return;
    }
    if (status != OC_OK) {
        ap_log_error(APLOG_MARK, APLOG_ERR, err, ctl.s, APLOGNO(90201) "mod_overtake_prio: "
                     "OvertakeControlFile %s: %s; the configured OvertakePrioLevels apply until "
                     "the sidecar writes it again", op_cconf->control_file, why);
        return;
    }
    thr[0] = 0;
    for (k = 0; k < op_hot.nlevels && n < (int)sizeof thr - 16; k++) {
        n += snprintf(thr + n, sizeof thr - (size_t)n, " %.6g",
                      (double)__atomic_load_n(&op_hot.thr_ns[k], __ATOMIC_RELAXED) / 1e9);
    }
    ap_log_error(APLOG_MARK, APLOG_NOTICE, 0, ctl.s, APLOGNO(90202) "mod_overtake_prio: "
                 "OvertakeControlFile %s generation %u: age thresholds%s s in force (%s)",
                 op_cconf->control_file, gen, thr,
                 ctl.from_file ? "the sidecar's policy" : "its policy chose none: the configured ones");
}

/* Put thresholds in force (the monitor and new requests read them): the file's of generation
 * gen, or with from_file 0 the configured ones. Caller holds ctl.mu. */
static void put_in_force(const int64_t *thr, uint32_t gen, int from_file)
{
    int k, changed = 0;
    if (gen != ctl.generation) {
        __atomic_fetch_add(&oc_shm->published, 1, __ATOMIC_RELEASE);  /* the other children look */
    }
    for (k = 0; k < op_hot.nlevels; k++) {
        changed |= __atomic_load_n(&op_hot.thr_ns[k], __ATOMIC_RELAXED) != thr[k];
        __atomic_store_n(&op_hot.thr_ns[k], thr[k], __ATOMIC_RELAXED);
    }
    ctl.generation = gen;
    __atomic_store_n(&ctl.from_file, from_file, __ATOMIC_RELAXED);
    if (changed) {
        /* the requests in flight take the new thresholds at the monitor's next pass */
        __atomic_fetch_add(&op_hot.thr_gen, 1, __ATOMIC_SEQ_CST);
        op_monitor_rearm();
    }
    else {
        op_monitor_wake();
    }
}

/* The configured thresholds back in force; code: an oc_status, or OC_WHY_* (logged once each). */
enum { OC_WHY_ABSENT = 101, OC_WHY_OPEN, OC_WHY_MAP, OC_WHY_FAULT, OC_WHY_KEY };
static void fall_back(int code, int err, const char *why)
{
    put_in_force(ctl.conf_thr, 0, 0);
    op_stage_table(NULL, 0, 0);  /* no count table: held requests run */
    ADD(oc_shm->refusals, 1);
    say(code, 0, err, why);
}

/* Map the file at the path if it is another inode than the one mapped. Caller holds ctl.mu. */
static const char *map_path(int fd, const struct stat *st)
{
    void *m;
    if (ctl.map && st->st_dev == ctl.dev && st->st_ino == ctl.ino) {
        return NULL;
    }
    if (!S_ISREG(st->st_mode)) {
        return "it is not a regular file";
    }
    m = mmap(NULL, OC_FILE_MAX_BYTES, PROT_READ, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED || !og_fault_install()) {
        if (m != MAP_FAILED) {
            munmap(m, OC_FILE_MAX_BYTES);
        }
        return "it cannot be mapped";
    }
    /* the old mapping stays: a request start may be loading from it */
    ctl.dev = st->st_dev;
    ctl.ino = st->st_ino;
    __atomic_store_n(&ctl.map, (const uint8_t *)m, __ATOMIC_RELEASE);
    return NULL;
}

/* Open the path, map it if it is another inode than the one mapped, and take its size (*n): NULL,
 * or why not (*code, and *err for errno). Caller holds ctl.mu. */
static const char *open_path(size_t *n, int *code, int *err)
{
    struct stat st;
    const char *why;
    int fd = open(op_cconf->control_file, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0 || fstat(fd, &st) != 0) {
        *err = errno;
        why = *err == ENOENT ? "it does not exist (no sidecar has written it)" : "it cannot be opened";
        *code = *err == ENOENT ? OC_WHY_ABSENT : OC_WHY_OPEN;
    }
    else {
        why = map_path(fd, &st);
        *code = OC_WHY_MAP;
        *n = (size_t)st.st_size;
    }
    if (fd >= 0) {
        close(fd);
    }
    if (!why && *n > OC_FILE_MAX_BYTES) {
        why = oc_reason(OC_SIZE);
        *code = OC_SIZE;
    }
    return why;
}

/* The periodic look of a request start found the file it accepted last: the same inode (still
 * mapped), the same size and the same generation word, which the sidecar bumps at every write.
 * Copying and checking it again (its MAC is the look's whole cost) would find what is in force.
 * Caller holds ctl.mu. */
static int unchanged(const uint8_t *was_mapped, size_t n)
{
    uint32_t g;
    return ctl.map && ctl.map == was_mapped && ctl.generation && n == ctl_len
           && og_load((const uint32_t *)(ctl.map + OC_GEN_OFFSET), &g) && g == ctl.generation;
}

/* Judge the file again and put what it says (or the configured values) in force. */
static void reload(int64_t now, int wait)
{
    const char *why;
    const uint8_t *was_mapped;
    uint32_t g1 = 1, g2 = 1;
    size_t n = 0;
    int tries, err = 0, code = 0;
    oc_status status = OC_OK;
    if (wait) {
        pthread_mutex_lock(&ctl.mu);
    }
    else if (pthread_mutex_trylock(&ctl.mu) != 0) {
        return;  /* another thread is at it: this request keeps the thresholds in force */
    }
    __atomic_store_n(&ctl.next_look, now + OC_LOOK_NS, __ATOMIC_RELAXED);
    was_mapped = ctl.map;
    why = open_path(&n, &code, &err);
    if (!why && !wait && unchanged(was_mapped, n)) {
        pthread_mutex_unlock(&ctl.mu);  /* the status page (wait) judges it in full */
        return;
    }
    for (tries = 0; !why && tries < 4; tries++) {
        const uint32_t *gw = (const uint32_t *)(ctl.map + OC_GEN_OFFSET);
        if (n < OC_HEAD_BYTES) {
            status = OC_SHORT;
            break;
        }
        if (!og_load(gw, &g1) || !guarded_copy(ctl_buf, ctl.map, n) || !og_load(gw, &g2)) {
            ADD(oc_shm->faults, 1);
            why = "it shrank under its mapping (truncated?)";
            code = OC_WHY_FAULT;
            break;
        }
        /* a generation that moved under the copy, or an odd one (with the right magic): the
         * sidecar is writing; try again, then leave the table in force to the next look */
        status = g1 == g2 ? oc_check(ctl_buf, n, (uint32_t)op_hot.nlevels, &control_mac, &ctl.tab)
                          : OC_BUSY;
        if (status != OC_BUSY) {
            break;
        }
    }
    if (!why && status == OC_OK && !control_key_loaded) {
        why = "its key file was refused at start (see above)";
        code = OC_WHY_KEY;
    }
    if (why || status != OC_OK) {
        /* requests look again when the generation word moves (or at the next look); busy: the
         * table in force (a whole one) stays meanwhile */
        uint32_t now_gen = 1u;
        if (ctl.map && !og_load((const uint32_t *)(ctl.map + OC_GEN_OFFSET), &now_gen)) {
            now_gen = 1u;
        }
        __atomic_store_n(&ctl.seen, now_gen, __ATOMIC_RELAXED);
        if (why) {
            fall_back(code, err, why);
        }
        else if (status != OC_BUSY) {
            fall_back((int)status, 0, oc_reason(status));
        }
    }
    else {
        __atomic_store_n(&ctl.seen, g1, __ATOMIC_RELAXED);
        if (ctl.tab.levels) {
            put_in_force(ctl.tab.rows[0].thr_ns, g1, 1);
        }
        else {
            put_in_force(ctl.conf_thr, g1, 0);
        }
        {
            size_t rows_end = OC_HEAD_BYTES + (size_t)(1 + ctl.tab.stages) * OC_ROW_BYTES;
            op_stage_table(ctl.tab.section ? ctl_buf + rows_end : NULL, n - rows_end, g1);
        }
        ctl_len = n;
        ADD(oc_shm->loads, 1);
        say(OC_OK, g1, 0, NULL);
    }
    __atomic_store_n(&ctl.judged, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&ctl.mu);
}

/* this child's last glance at the file (request_time) and the published count it had seen */
static apr_time_t glanced;
static uint32_t glanced_pub;

/* Before the CPU-priority start of every request: the thresholds of the file's newest table.
 * A look reads the clock and the mapping under a fault guard; a request start only compares its
 * request_time (Apache read the clock already) and the counter the children publish a new
 * generation on, so a change reaches this child at the next request after another child saw it
 * (the status page looks at every call), and at most OC_GLANCE_US later otherwise. */
OP_HOT int op_control_post_read_request(request_rec *r)
{
    uint32_t pub;
    apr_time_t last = __atomic_load_n(&glanced, __ATOMIC_RELAXED);
    if (!oc_shm) {
        return DECLINED;
    }
    pub = __atomic_load_n(&oc_shm->published, __ATOMIC_ACQUIRE);
    /* unsigned: a wall clock set back makes it large, and the child looks */
    if ((apr_uint64_t)(r->request_time - last) < OC_GLANCE_US
        && pub == __atomic_load_n(&glanced_pub, __ATOMIC_RELAXED)
        && __atomic_load_n(&ctl.judged, __ATOMIC_ACQUIRE)) {
        return DECLINED;
    }
    __atomic_store_n(&glanced, r->request_time, __ATOMIC_RELAXED);
    __atomic_store_n(&glanced_pub, pub, __ATOMIC_RELAXED);
    op_control_look();
    return DECLINED;
}

/* This child's table is the file's newest (a request start; a stage's completion, op_stage.c:
 * a process that started no request since the file changed decides by the new count table). */
void op_control_look(void)
{
    const uint8_t *m;
    uint32_t g;
    int64_t now;
    if (!op_cconf || !op_cconf->control_file || !oc_shm
        || !__atomic_load_n(&op_hot.child_ok, __ATOMIC_ACQUIRE)) {
        return;
    }
    now = op_mono_ns();
    if (!__atomic_load_n(&ctl.judged, __ATOMIC_ACQUIRE)) {
        /* a new child: its first requests wait for the first judgement, as a request that went
         * on with no count table in force would start every stage's held requests, in every
         * child (op_stage.c: no table, nothing waits) */
        reload(now, 1);
        return;
    }
    m = __atomic_load_n(&ctl.map, __ATOMIC_ACQUIRE);
    if (m && og_load((const uint32_t *)(m + OC_GEN_OFFSET), &g)) {
        if (g == __atomic_load_n(&ctl.seen, __ATOMIC_RELAXED)
            && now < __atomic_load_n(&ctl.next_look, __ATOMIC_RELAXED)) {
            return;
        }
    }
    else if (!__atomic_load_n(&ctl.from_file, __ATOMIC_RELAXED)
             && now < __atomic_load_n(&ctl.next_look, __ATOMIC_RELAXED)) {
        return;  /* a fault while the file's table is in force is judged at once */
    }
    reload(now, 0);
}

/* The status page: judge the file again before it shows what is in force. */
void op_control_refresh(const op_conf *c)
{
    if (c->control_file && oc_shm && __atomic_load_n(&op_hot.child_ok, __ATOMIC_ACQUIRE)) {
        reload(op_mono_ns(), 1);
    }
}

/* Threshold k (0-based) in force in this child, in seconds. */
double op_control_threshold(const op_conf *c, int k)
{
    if (__atomic_load_n(&op_hot.child_ok, __ATOMIC_ACQUIRE) && k < op_hot.nlevels) {
        return (double)__atomic_load_n(&op_hot.thr_ns[k], __ATOMIC_RELAXED) / 1e9;
    }
    return conf_threshold(c, k);
}

static void metric(request_rec *r, const char *name, const char *type, const char *help)
{
    ap_rprintf(r, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* The control file's part of the status page (op_control_refresh judged the file first). */
void op_control_status(request_rec *r, const op_conf *c)
{
    uint32_t r_, k;
    if (!c->control_file || !oc_shm) {
        return;
    }
    pthread_mutex_lock(&ctl.mu);
    metric(r, "overtake_cpu_prio_control_generation", "gauge",
           "Generation of the control file this child accepted last (0: none; absent or invalid).");
    ap_rprintf(r, "overtake_cpu_prio_control_generation %u\n", ctl.generation);
    metric(r, "overtake_cpu_prio_control_in_force", "gauge",
           "1 if the control file's thresholds are in force in this child, 0 if the configured "
           "OvertakePrioLevels are (no file, an invalid one, or a policy without thresholds).");
    ap_rprintf(r, "overtake_cpu_prio_control_in_force %d\n", ctl.from_file);
    metric(r, "overtake_cpu_prio_control_stage_threshold_seconds", "gauge",
           "Thresholds of the control file in force, by stage of the sidecar (stage=\"*\": every "
           "request, the row the module applies).");
    for (r_ = 0; ctl.from_file && r_ <= ctl.tab.stages; r_++) {
        for (k = 0; k < ctl.tab.levels; k++) {
            char stage[16];
            snprintf(stage, sizeof stage, r_ ? "%u" : "*", r_ - 1);
            ap_rprintf(r, "overtake_cpu_prio_control_stage_threshold_seconds{stage=\"%s\","
                       "level=\"%u\"} %.9g\n", stage, k + 1,
                       (double)ctl.tab.rows[r_].thr_ns[k] / 1e9);
        }
    }
    pthread_mutex_unlock(&ctl.mu);
    metric(r, "overtake_cpu_prio_control_loads_total", "counter",
           "Control-file tables put in force, by every child.");
    ap_rprintf(r, "overtake_cpu_prio_control_loads_total %" APR_UINT64_T_FMT "\n",
               LOAD(oc_shm->loads));
    metric(r, "overtake_cpu_prio_control_refusals_total", "counter",
           "Times a child found the control file absent or invalid and used the configured "
           "thresholds.");
    ap_rprintf(r, "overtake_cpu_prio_control_refusals_total %" APR_UINT64_T_FMT "\n",
               LOAD(oc_shm->refusals));
    metric(r, "overtake_cpu_prio_control_faults_total", "counter",
           "Loads that found the control file shrunk under its mapping.");
    ap_rprintf(r, "overtake_cpu_prio_control_faults_total %" APR_UINT64_T_FMT "\n",
               LOAD(oc_shm->faults));
}

/* Root parent (post_config): the shared counters, the key (created when missing) and the file. */
void op_control_prepare(apr_pool_t *p, server_rec *s, const op_conf *c)
{
    oc_shared **ret = ap_retained_data_get(OC_RETAINED_KEY);
    uint8_t key[32];
    const char *kpath, *why;
    if (!ret) {
        ret = ap_retained_data_create(OC_RETAINED_KEY, sizeof *ret);
        *ret = NULL;
    }
    if (!*ret) {
        void *m = mmap(NULL, sizeof(oc_shared), PROT_READ | PROT_WRITE,
                       MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) {
            ap_log_error(APLOG_MARK, APLOG_ERR, errno, s, APLOGNO(90203) "mod_overtake_prio: "
                         "cannot map the control file's counters; OvertakeControlFile is not used");
            return;
        }
        memset(m, 0, sizeof(oc_shared));
        *ret = m;
    }
    oc_shm = *ret;
    oc_shm->said = 0;  /* a (re)start says the state again */
    kpath = apr_pstrcat(p, c->control_file, ".key", NULL);
    why = op_key_file_load(p, kpath, key);
    control_key_loaded = !why;
    if (why) {
        ap_log_error(APLOG_MARK, APLOG_ERR, 0, s, APLOGNO(90204) "mod_overtake_prio: the key "
                     "file of OvertakeControlFile, %s, %s; the configured OvertakePrioLevels "
                     "apply", kpath, why);
    }
    else {
        og_hmac_init(&control_mac, key, sizeof key);
    }
    memset(key, 0, sizeof key);
    op_shared_file_prepare(s, c->control_file, "OvertakeControlFile");
}

/* Child (child_init, after op_hot): the configured thresholds, the fallback. */
void op_control_child_init(server_rec *s)
{
    int k;
    ctl.s = s;
    for (k = 0; k < op_hot.nlevels; k++) {
        ctl.conf_thr[k] = op_hot.thr_ns[k];
    }
}
