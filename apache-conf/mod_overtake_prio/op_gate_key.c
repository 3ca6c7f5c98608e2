/*
 * op_gate_key.c -- the admission gate's key and file, prepared in the root parent (post_config)
 * before the children start: FILE.key read (created when missing: Apache or the sidecar, whichever
 * starts first) and checked (root's, not readable by others), and the gate file given to the
 * workers' group. The children inherit the key's pad states; op_gate.c signs with them.
 */
#include "mod_overtake_prio.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "apr_general.h"
#include "apr_strings.h"
#include "unixd.h"

#include "og_hmac.h"

#define OG_KEY_BYTES 32

int op_gate_key_loaded;
/* the key's pad states (in op_gate_key.c only: og_hmac.h's types stay out of the shared header) */
static og_hmac_key gate_mac;

/* HMAC-SHA256 of msg under the gate's key (op_gate_key_loaded must be set). */
void op_gate_mac(const void *msg, size_t n, uint8_t out[32])
{
    og_hmac(&gate_mac, msg, n, out);
}

/* The key in path (64 hex digits) into key; NULL, or why not (*missing: no such file). A key
 * file of root's that gives its group nothing (0600) gets the workers' group: a sidecar gives a
 * gate file it creates the key file's group, so that the workers can read it. */
static const char *gate_key_read(apr_pool_t *p, const char *path, uint8_t key[OG_KEY_BYTES],
                                 int *missing)
{
    char buf[4 * OG_KEY_BYTES + 1];
    struct stat st;
    ssize_t n;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    *missing = fd < 0 && errno == ENOENT;
    if (fd < 0) {
        return apr_psprintf(p, "cannot be opened (%s)", strerror(errno));
    }
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return "is not a regular file (remove it)";
    }
    if (st.st_uid != 0 && st.st_uid != geteuid()) {
        close(fd);
        return apr_psprintf(p, "belongs to uid %ld: the key must belong to root (someone else "
                            "may know it; remove it, or chown root and let a sidecar that does "
                            "not run as root read it through the file's group)",
                            (long)st.st_uid);
    }
    if (st.st_mode & 027) {
        close(fd);
        return apr_psprintf(p, "has mode %04o: others may read or change it (chmod 0600, or "
                            "0640 for a sidecar that reads it through the file's group)",
                            (unsigned)(st.st_mode & 07777));
    }
    if (geteuid() == 0 && st.st_uid == 0 && !(st.st_mode & 070)
        && st.st_gid != ap_unixd_config.group_id) {
        (void)!fchown(fd, (uid_t)-1, ap_unixd_config.group_id);  /* best effort: see the file's */
    }
    n = read(fd, buf, sizeof buf - 1);
    close(fd);
    while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == '\r' || buf[n - 1] == ' ')) {
        n--;
    }
    if (n != 2 * OG_KEY_BYTES || !og_unhex(buf, OG_KEY_BYTES, key)) {
        return "does not hold 64 hex digits (remove it: Apache or the sidecar creates a new one)";
    }
    return NULL;
}

/* A new random key at path, mode 0600: written to a temporary file, then linked into place,
 * so that neither side ever reads half a key and a key the sidecar made meanwhile wins. */
static const char *gate_key_create(apr_pool_t *p, const char *path)
{
    uint8_t raw[OG_KEY_BYTES];
    char hex[2 * OG_KEY_BYTES + 2];
    const char *tmp = apr_psprintf(p, "%s.%ld.tmp", path, (long)getpid());
    int fd, ok, err;
    if (apr_generate_random_bytes(raw, sizeof raw) != APR_SUCCESS) {
        return "cannot be created (no random bytes from apr_generate_random_bytes)";
    }
    og_hex(raw, sizeof raw, hex);
    hex[2 * OG_KEY_BYTES] = '\n';
    memset(raw, 0, sizeof raw);
    fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
        return apr_psprintf(p, "cannot be created (%s)", strerror(errno));
    }
    ok = write(fd, hex, 2 * OG_KEY_BYTES + 1) == 2 * OG_KEY_BYTES + 1;
    err = errno;
    close(fd);
    memset(hex, 0, sizeof hex);
    if (ok && link(tmp, path) != 0 && errno != EEXIST) {
        ok = 0;
        err = errno;
    }
    unlink(tmp);
    return ok ? NULL : apr_psprintf(p, "cannot be created (%s)", strerror(err));
}

/* Root only: a file the sidecar writes (the gate's, the control file) exists (empty until a
 * sidecar writes it) and belongs to the workers' group, mode 0640, so that they can read it and
 * other users cannot. A file of a sidecar that does not run as root is left as it is (its group
 * must be the workers'). */
void op_shared_file_prepare(server_rec *s, const char *path, const char *directive)
{
    struct stat st;
    int fd;
    if (geteuid() != 0) {
        return;
    }
    fd = open(path, O_RDONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0640);
    if (fd < 0) {
        ap_log_error(APLOG_MARK, APLOG_WARNING, errno, s, APLOGNO(90110) "mod_overtake_prio: "
                     "cannot create %s %s; the sidecar creates it (its group must be "
                     "Apache's Group for the workers to read it)", directive, path);
        return;
    }
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == 0
        && (fchown(fd, (uid_t)-1, ap_unixd_config.group_id) != 0 || fchmod(fd, 0640) != 0)) {
        ap_log_error(APLOG_MARK, APLOG_WARNING, errno, s, APLOGNO(90111) "mod_overtake_prio: "
                     "cannot give %s %s to group %ld, mode 0640; the workers may not "
                     "read it", directive, path, (long)ap_unixd_config.group_id);
    }
    close(fd);
}

/* The key of a file the sidecar writes, in kpath (created when missing); NULL, or why not. */
const char *op_key_file_load(apr_pool_t *p, const char *kpath, uint8_t key[32])
{
    int missing;
    const char *why = gate_key_read(p, kpath, key, &missing);
    if (why && missing) {
        why = gate_key_create(p, kpath);
        if (!why) {
            why = gate_key_read(p, kpath, key, &missing);
        }
    }
    return why;
}

/* The key (created when missing) and the file, before the children start. */
void op_gate_prepare(apr_pool_t *p, server_rec *s, const op_conf *c)
{
    const char *kpath = apr_pstrcat(p, c->gate_file, ".key", NULL);
    uint8_t key[OG_KEY_BYTES];
    const char *why = op_key_file_load(p, kpath, key);
    op_gate_key_loaded = !why;
    if (why) {
        ap_log_error(APLOG_MARK, APLOG_ERR, 0, s, APLOGNO(90112) "mod_overtake_prio: the key "
                     "file of OvertakeGate, %s, %s; gated requests pass at once (the sidecar "
                     "keeps its queue itself)", kpath, why);
    }
    else {
        og_hmac_init(&gate_mac, key, sizeof key);
    }
    memset(key, 0, sizeof key);
    op_shared_file_prepare(s, c->gate_file, "OvertakeGate");
}
