/*
 * op_gate.c -- the admission gate: a request carrying the sidecar's gate header waits, before
 * anything else runs for it, on a futex word of a file the sidecar maps too, until the sidecar
 * opens it (admission) or cancels it (503); an idle start runs at the lowest level until then
 * and the promoter thread gives it its priority back. The gate's key and file are prepared by
 * the root parent (op_gate_key.c).
 *
 * og_fault.h's state is static, one copy per file that includes it: every guarded load from
 * the gate file is made here, so that its SIGBUS handler sees the load's jump buffer.
 */
#include "mod_overtake_prio.h"
#include "op_guard.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "apr_strings.h"
#include "http_connection.h"
#include "http_core.h"
#include "http_protocol.h"

#include "og_fault.h"
#include "og_hmac.h"

/* The gate file, written by the sidecar (controller/sidecar/gate.py): a 64-byte head, then one 32-bit
 * futex word per slot, (generation << 2) | state. The sidecar arms a slot (new generation,
 * WAIT) before it sends the request, opens it when the policy admits the request, cancels it
 * when the request is withdrawn, and moves it to the next generation when the exchange ends,
 * so a late or duplicate request on an old generation finds it stale.
 *
 * A gated request's header is "SLOT GENERATION MAC": MAC is the first 128 bits, in hex, of
 * HMAC-SHA256(key, "TOKEN SLOT GENERATION") with the file's pairing token, so a client that
 * reaches Apache directly cannot park a worker with a slot it read or guessed (403 at once).
 * The key is FILE.key, read by the root parent before the children start (created there when
 * missing); the head carries HMAC(key, "OVTGATE2 file SLOTS TOKEN"), and only a file written
 * with this key is mapped, so a file put at the path by anyone else is never used.
 *
 * The file can shrink under the mapping (truncate): every load from it goes through og_load
 * (og_fault.h), which turns the SIGBUS into a failed load; the file then counts as gone and
 * gated requests, held ones included, pass at once, as without a file. */
#define OG_MAGIC "OVTGATE2"
enum { OG_WAIT = 0, OG_OPEN = 1, OG_CANCEL = 2, OG_IDLE = 3 };
#define OG_SLICE_NS 100000000   /* between checks that the sidecar still holds the connection */
#define OG_MAX_SLOTS (1u << 20) /* the sidecar's gate_slots bound */

typedef struct {
    char magic[8];
    uint32_t nslots;
    uint32_t token;             /* the sidecar's random pairing token, shown in the status */
    uint32_t epoch;             /* bumped (and woken) by the sidecar when it opens an idle start */
    uint32_t reserved[3];
    uint8_t keycheck[32];       /* HMAC(key, "OVTGATE2 file SLOTS TOKEN") */
} og_head;

/* Every mapping covers the largest file, so a file that shrinks and grows again in place
 * (a restarted sidecar with another slot count) is served by the same mapping. */
#define OG_MAP_BYTES (sizeof(og_head) + 4 * (size_t)OG_MAX_SLOTS)

/* A checked file as requests use it, published whole (never freed: a request may hold it). */
typedef struct {
    og_head *head;
    uint32_t *words;
    uint32_t nslots;
} og_view;

/* What a child has said about its file since the file was last good (each once). */
enum { OG_SAID_UNMAPPED = 1, OG_SAID_FAULT = 2, OG_SAID_GONE = 4, OG_SAID_FOREIGN = 8,
       OG_SAID_CHANGED = 16 };

static pthread_t promoter;      /* restores idle starts on admission (op_promote) */
static int promoter_running;
static volatile int promoter_stop;
static int said_forged, said_invalid;   /* first forged / malformed header of this child */

static struct {
    pthread_mutex_t mu;         /* guards the fields below but reads of view */
    og_view *view;              /* published (release) while the file is usable; NULL: pass */
    og_view *last;              /* the newest view made, republished when the file is good again */
    og_head *map;               /* this child's mapping (OG_MAP_BYTES) of the inode below */
    dev_t dev;
    ino_t ino;
    unsigned said;              /* OG_SAID_* */
    server_rec *s;
} gate = {PTHREAD_MUTEX_INITIALIZER, NULL, NULL, NULL, 0, 0, 0, NULL};

/* A guarded load found the page of addr gone: the file shrank under the mapping. If it is the
 * mapping in use, requests pass from now on, until a gate_map finds a good file again. */
void op_gate_fault(const void *addr)
{
    const char *a = addr;
    int first;
    ADD(op_shm->gate_faults, 1);
    pthread_mutex_lock(&gate.mu);
    if (gate.map && a >= (const char *)gate.map && a < (const char *)gate.map + OG_MAP_BYTES) {
        __atomic_store_n(&gate.view, NULL, __ATOMIC_RELEASE);
    }
    first = !(gate.said & OG_SAID_FAULT);
    gate.said |= OG_SAID_FAULT;
    pthread_mutex_unlock(&gate.mu);
    if (first) {
        ap_log_error(APLOG_MARK, APLOG_ERR, 0, gate.s, APLOGNO(90101) "mod_overtake_prio: "
                     "OvertakeGate %s shrank under its mapping (truncated?): requests held on it "
                     "and new gated requests pass at once until the sidecar writes it again",
                     op_cconf->gate_file);
    }
}

/* *out = *w from the gate mapping; 0 (and the file counts as gone) if its page is gone. */
static int gate_load(const uint32_t *w, uint32_t *out)
{
    if (og_load(w, out)) {
        return 1;
    }
    op_gate_fault(w);
    return 0;
}

/* Why the open file fd (st) is no gate file of this server's key, or NULL; *h: its head.
 * Read with pread, not through a mapping: nothing here can fault. */
static const char *gate_check(int fd, const struct stat *st, og_head *h)
{
    uint8_t want[32];
    char msg[64];
    int n;
    if (!S_ISREG(st->st_mode)) {
        return "it is not a regular file";
    }
    if (pread(fd, h, sizeof *h, 0) != (ssize_t)sizeof *h) {
        return "it is shorter than a gate file's head (empty: no sidecar has written it yet)";
    }
    if (memcmp(h->magic, OG_MAGIC, 8)) {
        return "it has no " OG_MAGIC " head (not written by a sidecar of this version)";
    }
    if (h->nslots == 0 || h->nslots > OG_MAX_SLOTS
        || st->st_size != (off_t)(sizeof *h + 4 * (uint64_t)h->nslots)) {
        return "its size does not match its slot count";
    }
    n = snprintf(msg, sizeof msg, "OVTGATE2 file %u %u", h->nslots, h->token);
    op_gate_mac(msg, (size_t)n, want);
    if (!og_equal(want, h->keycheck, sizeof want)) {
        return "it was not written with this server's key (a sidecar that read another key "
               "file, or no sidecar's file)";
    }
    return NULL;
}

/* Publish a view of the mapping with n slots (the last one made, if it is the same).
 * Caller holds gate.mu. */
static int gate_publish(uint32_t n)
{
    og_view *v = gate.last;
    if (!v || v->head != gate.map || v->nslots != n) {
        v = malloc(sizeof *v);
        if (!v) {
            return 0;
        }
        v->head = gate.map;
        v->words = (uint32_t *)(gate.map + 1);
        v->nslots = n;
        gate.last = v;
    }
    __atomic_store_n(&gate.view, v, __ATOMIC_RELEASE);
    return 1;
}

/* Map the gate file and publish it; 1 if a usable file is published. A request (recheck 0)
 * looks only while none is; the status page (recheck 1) judges the path again every time. The
 * file changed in place (same inode): judged again, unpublished if no longer good. Another
 * inode at the path: mapped if good (a sidecar that re-created it), else ignored; the old
 * mapping stays (requests may still wait on it: they end by the sidecar, stale or by the
 * connection check). Each change is logged once. */
static int gate_map(int recheck)
{
    struct stat st;
    og_head h;
    const char *why = NULL;
    unsigned say = 0;
    int fd, same = 0, gone = 0, err = 0, ok;
    if (!op_gate_key_loaded) {
        return 0;  /* said at start: gated requests pass */
    }
    if (__atomic_load_n(&gate.view, __ATOMIC_ACQUIRE) && !recheck) {
        return 1;
    }
    pthread_mutex_lock(&gate.mu);
    fd = open(op_cconf->gate_file, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0 || fstat(fd, &st) != 0) {
        err = errno;
        gone = err == ENOENT;
        why = "it cannot be opened";
    }
    else {
        same = gate.map && st.st_dev == gate.dev && st.st_ino == gate.ino;
        why = gate_check(fd, &st, &h);
        if (!why && !same) {
            void *m = mmap(NULL, OG_MAP_BYTES, PROT_READ, MAP_SHARED, fd, 0);
            if (m == MAP_FAILED || !og_fault_install()) {
                err = errno;
                why = "it cannot be mapped";
                if (m != MAP_FAILED) {
                    munmap(m, OG_MAP_BYTES);
                }
            }
            else {
                gate.map = m;
                gate.dev = st.st_dev;
                gate.ino = st.st_ino;
                same = 1;
            }
        }
    }
    if (fd >= 0) {
        close(fd);
    }
    if (!why) {
        if (gate_publish(h.nslots)) {
            gate.said = 0;
        }
    }
    else if (gate.view && same) {  /* the file in use changed: truncated, or another key's */
        __atomic_store_n(&gate.view, NULL, __ATOMIC_RELEASE);
        say = OG_SAID_CHANGED;
    }
    else if (gate.view) {          /* removed or replaced: what waits keeps the old file */
        say = gone ? OG_SAID_GONE : OG_SAID_FOREIGN;
    }
    if (say & gate.said) {
        say = 0;
    }
    gate.said |= say;
    ok = __atomic_load_n(&gate.view, __ATOMIC_ACQUIRE) != NULL;
    pthread_mutex_unlock(&gate.mu);
    if (say == OG_SAID_CHANGED) {
        ap_log_error(APLOG_MARK, APLOG_ERR, err, gate.s, APLOGNO(90102) "mod_overtake_prio: "
                     "OvertakeGate %s changed under its mapping: %s; gated requests pass at once "
                     "until the sidecar writes it again", op_cconf->gate_file, why);
    }
    else if (say == OG_SAID_GONE) {
        ap_log_error(APLOG_MARK, APLOG_WARNING, 0, gate.s, APLOGNO(90103) "mod_overtake_prio: "
                     "OvertakeGate %s was removed; requests keep waiting on the file mapped "
                     "before (the sidecar sends no new ones to it)", op_cconf->gate_file);
    }
    else if (say == OG_SAID_FOREIGN) {
        ap_log_error(APLOG_MARK, APLOG_WARNING, err, gate.s, APLOGNO(90104) "mod_overtake_prio: "
                     "OvertakeGate %s was replaced by a file this server does not use: %s; "
                     "requests keep waiting on the file mapped before", op_cconf->gate_file, why);
    }
    return ok;
}

/* The sidecar closed the connection (it gave the request up, or it went away)? */
static int gate_client_gone(conn_rec *c)
{
    apr_socket_t *sock = ap_get_conn_socket(c);
    apr_os_sock_t fd;
    char b;
    ssize_t n;
    if (!sock || apr_os_sock_get(&fd, sock) != APR_SUCCESS) {
        return 0;
    }
    n = recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

/* The header's MAC is the key's for this file (token), slot and generation? Constant time. */
static int gate_verify(uint32_t token, unsigned long slot, unsigned long gen,
                       const uint8_t mac[OG_MAC_BYTES])
{
    char msg[48];
    uint8_t want[32];
    int n = snprintf(msg, sizeof msg, "%u %lu %lu", token, slot, gen);
    op_gate_mac(msg, (size_t)n, want);
    return og_equal(want, mac, OG_MAC_BYTES);
}

/* Log level of a refused header: the first of this child at WARNING, the rest (counted on the
 * status page) at DEBUG, so that a flood of them does not flood the log. */
static int gate_refusal_level(int *said)
{
    return __atomic_exchange_n(said, 1, __ATOMIC_RELAXED) ? APLOG_DEBUG : APLOG_WARNING;
}

/* Before every other hook of the request (and before the CPU-priority start, so that neither
 * its wall age nor its thread CPU counts the wait). */
int op_gate_post_read_request(request_rec *r)
{
    const char *h;
    unsigned long slot, gen;
    uint8_t mac[OG_MAC_BYTES];
    og_view *view;
    uint32_t *w, v, token;
    int64_t t0, deadline, now;
    int slices = 0;

    if (!op_cconf || !op_cconf->gate_file || !op_shm || r->main || r->prev) {
        return DECLINED;
    }
    h = apr_table_get(r->headers_in, conf_gate_header(op_cconf));
    if (!h) {
        return DECLINED;
    }
    if (!op_parse_gate(h, &slot, &gen, mac)) {
        ADD(op_shm->gate_invalid, 1);
        ap_log_rerror(APLOG_MARK, gate_refusal_level(&said_invalid), 0, r, APLOGNO(90105)
                      "mod_overtake_prio: %s: '%.80s' is not 'SLOT GENERATION MAC' (400; "
                      "further ones are counted in overtake_gate_invalid_total)",
                      conf_gate_header(op_cconf), h);
        return HTTP_BAD_REQUEST;
    }
    apr_table_unset(r->headers_in, conf_gate_header(op_cconf));
    view = gate_map(0) ? __atomic_load_n(&gate.view, __ATOMIC_ACQUIRE) : NULL;
    if (!view || !gate_load(&view->head->token, &token)) {
        int first;
        ADD(op_shm->gate_unmapped, 1);
        pthread_mutex_lock(&gate.mu);
        first = !(gate.said & (OG_SAID_UNMAPPED | OG_SAID_FAULT));
        gate.said |= OG_SAID_UNMAPPED;
        pthread_mutex_unlock(&gate.mu);
        if (first) {
            ap_log_rerror(APLOG_MARK, APLOG_ERR, 0, r, APLOGNO(90106) "mod_overtake_prio: "
                          "OvertakeGate %s %s; gated requests pass at once", op_cconf->gate_file,
                          op_gate_key_loaded ? "is missing or not a gate file of this server's key "
                          "(start the sidecar with --gate on the same path)"
                          : "is not used: its key file was refused at start (see above)");
        }
        return DECLINED;
    }
    if (!gate_verify(token, slot, gen, mac)) {
        ADD(op_shm->gate_forged, 1);
        ap_log_rerror(APLOG_MARK, gate_refusal_level(&said_forged), 0, r, APLOGNO(90107)
                      "mod_overtake_prio: %s: slot %lu generation %lu carries a MAC that is not "
                      "the sidecar's (403; further ones are counted in "
                      "overtake_gate_forged_total)", conf_gate_header(op_cconf), slot, gen);
        return HTTP_FORBIDDEN;
    }
    if (slot >= view->nslots) {
        ADD(op_shm->gate_invalid, 1);
        ap_log_rerror(APLOG_MARK, APLOG_WARNING, 0, r, APLOGNO(90108) "mod_overtake_prio: gate "
                      "slot %lu is beyond the file's %u", slot, view->nslots);
        return HTTP_BAD_REQUEST;
    }
    w = &view->words[slot];
    t0 = op_mono_ns();
    deadline = t0 + (int64_t)(conf_gate_timeout(op_cconf) * 1e9);
    for (;;) {
        struct timespec ts;
        int64_t left;
        if (!gate_load(w, &v)) {  /* the file shrank: as without a file */
            ADD(op_shm->gate_unmapped, 1);
            return DECLINED;
        }
        if ((v >> 2) != gen) {
            ADD(op_shm->gate_stale, 1);
            return HTTP_SERVICE_UNAVAILABLE;
        }
        if ((v & 3) == OG_OPEN) {
            break;
        }
        /* idle start: only where this child can demote (and restore) its threads */
        if ((v & 3) == OG_IDLE && __atomic_load_n(&op_hot.child_ok, __ATOMIC_ACQUIRE) && promoter_running
            && !op_guard_cause(r)) {  /* an exempt request never runs at the idle level */
            apr_table_setn(r->notes, OG_NOTE, apr_psprintf(r->pool, "%lu %lu", slot, gen));
            ADD(op_shm->gate_idle_starts, 1);
            return DECLINED;  /* op_post_read_request starts it at the idle level */
        }
        if ((v & 3) == OG_CANCEL) {
            ADD(op_shm->gate_cancels, 1);
            return HTTP_SERVICE_UNAVAILABLE;
        }
        now = op_mono_ns();
        if (now >= deadline) {
            ADD(op_shm->gate_timeouts, 1);
            ap_log_rerror(APLOG_MARK, APLOG_WARNING, 0, r, APLOGNO(90109) "mod_overtake_prio: "
                          "gate slot %lu not opened within OvertakeGateTimeout %g s; let through",
                          slot, conf_gate_timeout(op_cconf));
            return DECLINED;
        }
        /* a slice ended without news: is the sidecar still there? (one recv per 100 ms) */
        if (slices++ && gate_client_gone(r->connection)) {
            ADD(op_shm->gate_aborts, 1);
            r->connection->keepalive = AP_CONN_CLOSE;
            return HTTP_SERVICE_UNAVAILABLE;
        }
        left = deadline - now < OG_SLICE_NS ? deadline - now : OG_SLICE_NS;
        ts.tv_sec = (time_t)(left / 1000000000);
        ts.tv_nsec = (long)(left % 1000000000);
        /* shared (not FUTEX_PRIVATE): the sidecar's process wakes us through its own mapping;
         * a page gone under it is EFAULT here, and the next load says so */
        syscall(SYS_futex, w, FUTEX_WAIT, v, &ts, NULL, 0);
    }
    ADD(op_shm->gate_held, 1);
    ADD(op_shm->gate_wait_ns, (apr_uint64_t)(op_mono_ns() - t0));
    return DECLINED;
}

/* Waits on the gate file's epoch word (the sidecar bumps and wakes it when it opens an idle
 * start) and restores every idle start whose slot is open, cancelled, moved on or gone. */
static void *promoter_main(void *arg)
{
    uint32_t seen = 0;
    sigset_t bus;
    (void)arg;
    /* started with every signal blocked; a guarded load needs SIGBUS (og_fault.h) */
    sigemptyset(&bus);
    sigaddset(&bus, SIGBUS);
    pthread_sigmask(SIG_UNBLOCK, &bus, NULL);
    while (!promoter_stop) {
        og_view *view = __atomic_load_n(&gate.view, __ATOMIC_ACQUIRE);
        struct timespec ts = {0, 50000000};  /* 50 ms: also the bound on a missed wake-up */
        int n, i;
        if (!view) {
            nanosleep(&ts, NULL);
            gate_map(0);
        }
        else {
            syscall(SYS_futex, &view->head->epoch, FUTEX_WAIT, seen, &ts, NULL, 0);
            if (!gate_load(&view->head->epoch, &seen)) {
                nanosleep(&ts, NULL);  /* EFAULT returns at once: no busy loop */
            }
        }
        n = op_slots_in_use();
        for (i = 0; i < n; i++) {
            op_slot *s = &op_slots[i];
            const uint32_t *gw = NULL;
            uint32_t v;
            if (!__atomic_load_n(&s->gate_word, __ATOMIC_ACQUIRE)) {
                continue;
            }
            pthread_mutex_lock(&s->mu);
            if (s->gate_word && op_slot_claim(s)) {
                if (!og_load(s->gate_word, &v)) {
                    gw = s->gate_word;  /* the file shrank: let it run at its own priority */
                    op_promote(s);
                }
                else if ((v >> 2) != s->gate_gen || (v & 3) != OG_IDLE) {
                    op_promote(s);
                }
                op_slot_unclaim(s);
            }
            pthread_mutex_unlock(&s->mu);
            if (gw) {
                op_gate_fault(gw);
            }
        }
    }
    return NULL;
}

/* Start the promoter (child_init, with idle levels and a gate); 0 if it could not start. */
int op_promoter_start(void)
{
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    promoter_running = pthread_create(&promoter, NULL, promoter_main, NULL) == 0;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return promoter_running;
}

/* Stop it and wait for it (child exit). */
void op_promoter_stop(void)
{
    if (promoter_running) {
        promoter_stop = 1;  /* it wakes within its 50 ms wait */
        pthread_join(promoter, NULL);
        promoter_running = 0;
    }
}

/* ---- in a request start: an idle start ------------------------------------------------ */

/* The gate word and generation of an idle start's note ("SLOT GEN"); 0 if the note names no
 * slot of the mapped file. */
int op_gate_idle_word(const char *note, const uint32_t **word, uint32_t *gen)
{
    og_view *gv = __atomic_load_n(&gate.view, __ATOMIC_ACQUIRE);
    unsigned long gslot, ggen;
    if (gv && sscanf(note, "%lu %lu", &gslot, &ggen) == 2 && gslot < gv->nslots) {
        *word = &gv->words[gslot];
        *gen = (uint32_t)ggen;
        return 1;
    }
    return 0;
}

/* An idle start, now at the lowest level: the promoter restores it when its slot opens; one
 * opened (or given up) meanwhile runs at its own priority at once. Caller holds s->mu. Returns
 * the word if the file shrank under it (the caller reports op_gate_fault after the unlock). */
const uint32_t *op_gate_idle_hold(op_slot *s, const uint32_t *word, uint32_t gen)
{
    uint32_t v = 0;
    if (!og_load(word, &v)) {
        return word;  /* the file shrank: it runs at its own priority */
    }
    if ((v >> 2) == gen && (v & 3) == OG_IDLE) {
        s->gate_word = word;
        s->gate_gen = gen;
    }
    else if (s->level > 0) {
        op_promote(s);
    }
    return NULL;
}

/* ---- the status page's view -------------------------------------------------------------- */

/* The key and the file this child uses; the path is judged again (gate_map(1)). */
void op_gate_snapshot(const op_conf *c, op_gate_state *st)
{
    int mapped = c->gate_file && op_cconf && gate_map(1);
    og_view *gv = mapped ? __atomic_load_n(&gate.view, __ATOMIC_ACQUIRE) : NULL;
    uint32_t token = 0;
    mapped = gv && gate_load(&gv->head->token, &token);
    st->key_loaded = op_gate_key_loaded;
    st->mapped = mapped;
    st->token = mapped ? token : 0u;
    st->nslots = mapped ? gv->nslots : 0u;
}

void op_gate_child_init(server_rec *s)
{
    gate.s = s;
}
