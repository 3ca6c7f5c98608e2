/* overtake_prio's restorer (op_restorer.h says what it is for). */
#include "op_restorer.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* The kernel's struct sched_attr, first version (48 bytes; linux/sched/types.h, whose own
 * struct sched_param clashes with glibc's). */
typedef struct {
    uint32_t size, sched_policy;
    uint64_t sched_flags;
    int32_t sched_nice;
    uint32_t sched_priority;
    uint64_t sched_runtime, sched_deadline, sched_period;
} op_sched_attr;

int op_restore_pid(pid_t pid, int nice, bool idle)
{
    int rc = 0;
    if (idle) {
        /* Policy and nice value in one call (sched_setattr): two calls would leave the worker
         * for a moment at the demoted nice value under SCHED_OTHER. ENOSYS: the two calls. */
        op_sched_attr a;
        struct sched_param p = {0};
        memset(&a, 0, sizeof a);
        a.size = sizeof a;
        a.sched_policy = SCHED_OTHER;
        a.sched_nice = nice;
        if (syscall(SYS_sched_setattr, pid, &a, 0) == 0) {
            return 0;
        }
        if (errno != ENOSYS) {
            rc = -1;
        }
        else {
            rc = sched_setscheduler(pid, SCHED_OTHER, &p);
        }
    }
    if (setpriority(PRIO_PROCESS, (id_t)pid, nice) != 0) {
        rc = -1;
    }
    return rc;
}

static pid_t restorer_pid;    /* in the master: the restorer process, 0 if none */
static pid_t restorer_master; /* the master's pid: names the socket */
static int restorer_sock = -1; /* in a worker: its socket to the restorer */

typedef struct {
    int32_t nice;     /* the worker's normal nice */
    int32_t idle;     /* leave SCHED_IDLE too */
    int32_t kind;     /* OP_RESTORE_* */
    int32_t after_ms; /* OP_RESTORE_AFTER: the bound on the time at the low level */
} op_restore_msg;

/* In the restorer: the deadlines of demoted workers, one per worker (a newer one replaces it). */
#define OP_DEADLINES 1024
typedef struct {
    pid_t pid; /* 0: free */
    int32_t nice, idle;
    struct timespec at;
} op_deadline;

static socklen_t restorer_addr(pid_t master, struct sockaddr_un *sa)
{
    int n;
    memset(sa, 0, sizeof *sa);
    sa->sun_family = AF_UNIX;
    /* abstract namespace: no file to create, clean up or protect */
    n = snprintf(sa->sun_path + 1, sizeof sa->sun_path - 1, "overtake_prio.%d", (int)master);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

/* Is pid a child of the master (a worker), as /proc says? */
static bool is_worker(pid_t pid, pid_t master)
{
    char path[64], buf[512];
    const char *p;
    ssize_t n;
    int fd;
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        return false;
    }
    n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) {
        return false;
    }
    buf[n] = '\0';
    p = strstr(buf, "\nPPid:");
    return p != NULL && (pid_t)strtol(p + 7, NULL, 10) == master;
}

static int64_t ms_until(const struct timespec *at)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)(at->tv_sec - now.tv_sec) * 1000 + (at->tv_nsec - now.tv_nsec + 999999) / 1000000;
}

/* Restore every worker whose deadline has come; the milliseconds to the next one (-1: none). */
static int fire_deadlines(op_deadline *d, pid_t master)
{
    int i, next = -1;
    for (i = 0; i < OP_DEADLINES; i++) {
        int64_t left;
        if (d[i].pid == 0) {
            continue;
        }
        left = ms_until(&d[i].at);
        if (left <= 0) {
            if (is_worker(d[i].pid, master)) {
                op_restore_pid(d[i].pid, d[i].nice, d[i].idle != 0);
            }
            d[i].pid = 0;
        } else if (next < 0 || left < next) {
            next = (int)(left < INT32_MAX ? left : INT32_MAX);
        }
    }
    return next;
}

/* Note (or, after_ms < 0, forget) the deadline of pid. */
static void set_deadline(op_deadline *d, pid_t pid, const op_restore_msg *m, int after_ms)
{
    int i, slot = -1;
    for (i = 0; i < OP_DEADLINES; i++) {
        if (d[i].pid == pid) {
            d[i].pid = 0;
        }
        if (d[i].pid == 0 && slot < 0) {
            slot = i;
        }
    }
    if (after_ms < 0 || slot < 0) {
        return; /* full: the worker's own timer is the bound */
    }
    d[slot].pid = pid;
    d[slot].nice = m->nice;
    d[slot].idle = m->idle;
    clock_gettime(CLOCK_MONOTONIC, &d[slot].at);
    d[slot].at.tv_sec += after_ms / 1000;
    d[slot].at.tv_nsec += (long)(after_ms % 1000) * 1000000L;
    if (d[slot].at.tv_nsec >= 1000000000L) {
        d[slot].at.tv_sec += 1;
        d[slot].at.tv_nsec -= 1000000000L;
    }
}

static void restorer_loop(int fd, pid_t master, int floor_nice)
{
    static op_deadline deadlines[OP_DEADLINES];
    for (;;) {
        struct pollfd pfd = {fd, POLLIN, 0};
        op_restore_msg m;
        struct sockaddr_un from;
        char cbuf[CMSG_SPACE(sizeof(struct ucred))];
        struct iovec iov = {&m, sizeof m};
        struct msghdr h;
        struct cmsghdr *c;
        struct ucred *cred = NULL;
        char ok = 0;
        bool valid;
        ssize_t n;
        if (poll(&pfd, 1, fire_deadlines(deadlines, master)) <= 0) {
            continue; /* a deadline came (or a signal) */
        }
        memset(&h, 0, sizeof h);
        h.msg_name = &from;
        h.msg_namelen = sizeof from;
        h.msg_iov = &iov;
        h.msg_iovlen = 1;
        h.msg_control = cbuf;
        h.msg_controllen = sizeof cbuf;
        n = recvmsg(fd, &h, 0);
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            _exit(0);
        }
        if (getppid() != master) {
            _exit(0); /* the master is gone */
        }
        for (c = CMSG_FIRSTHDR(&h); c != NULL; c = CMSG_NXTHDR(&h, c)) {
            if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_CREDENTIALS) {
                cred = (struct ucred *)CMSG_DATA(c);
            }
        }
        /* only the asking worker itself, never above the master's own priority */
        valid = n == (ssize_t)sizeof m && cred != NULL && m.nice >= floor_nice && m.nice <= 19
                && is_worker(cred->pid, master);
        if (n == (ssize_t)sizeof m && m.kind == OP_RESTORE_AFTER) {
            if (valid) {
                set_deadline(deadlines, cred->pid, &m, m.after_ms >= 0 ? m.after_ms : 0);
            }
            continue; /* no answer: the worker does not wait for one */
        }
        if (valid) {
            set_deadline(deadlines, cred->pid, &m, -1);
            ok = op_restore_pid(cred->pid, m.nice, m.idle != 0) == 0;
        }
        sendto(fd, &ok, 1, MSG_DONTWAIT, (struct sockaddr *)&from, h.msg_namelen);
    }
}

/* In the master at start-up, as root: fork the restorer. */
void op_start_restorer(void)
{
    struct sockaddr_un sa;
    socklen_t len;
    int one = 1, fd;
    pid_t master = getpid(), pid;
    if (geteuid() != 0) {
        return; /* not started as root: no privilege to keep */
    }
    fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        return;
    }
    len = restorer_addr(master, &sa);
    if (bind(fd, (struct sockaddr *)&sa, len) != 0 || setsockopt(fd, SOL_SOCKET, SO_PASSCRED, &one, sizeof one) != 0) {
        close(fd);
        return;
    }
    pid = fork();
    if (pid == 0) {
        int floor_nice = getpriority(PRIO_PROCESS, 0);
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != master) {
            _exit(0);
        }
        prctl(PR_SET_NAME, "overtake_prio");
        restorer_loop(fd, master, floor_nice);
        _exit(0);
    }
    close(fd);
    if (pid > 0) {
        restorer_pid = pid;
        restorer_master = master;
    }
}

/* In a worker: send the restorer a message (async-signal-safe: the timer's handler sends too). */
bool op_tell_restorer(int kind, int after_ms, int nice, bool idle)
{
    struct sockaddr_un sa;
    socklen_t len;
    op_restore_msg m = {nice, idle ? 1 : 0, kind, after_ms};
    if (restorer_master == 0) {
        return false;
    }
    if (restorer_sock < 0) {
        struct timeval tv = {1, 0};
        sa_family_t family = AF_UNIX;
        restorer_sock = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
        if (restorer_sock < 0) {
            return false;
        }
        /* autobind: a unique abstract address the restorer answers to */
        bind(restorer_sock, (struct sockaddr *)&family, sizeof family);
        setsockopt(restorer_sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    }
    len = restorer_addr(restorer_master, &sa);
    return sendto(restorer_sock, &m, sizeof m, MSG_DONTWAIT, (struct sockaddr *)&sa, len) == (ssize_t)sizeof m;
}

/* In a worker: ask the restorer (which also forgets our deadline); true once it has restored us. */
bool op_ask_restorer(int nice, bool idle)
{
    char ok = 0;
    return op_tell_restorer(OP_RESTORE_NOW, 0, nice, idle) && recv(restorer_sock, &ok, 1, 0) == 1 && ok == 1;
}

bool op_restorer_known(void)
{
    return restorer_master != 0;
}

/* In the master at shut-down: stop the restorer it forked (not from a worker, which inherited the pid). */
void op_stop_restorer(void)
{
    if (restorer_pid > 0 && getpid() == restorer_master) {
        kill(restorer_pid, SIGKILL);
        waitpid(restorer_pid, NULL, 0);
        restorer_pid = 0;
    }
}
