/*
 * op_guard_pure.c -- the priority-inversion guard's directive words and request matching,
 * without Apache (see op_guard_pure.h).
 */
#include <string.h>
#include <strings.h>

#include "op_guard_pure.h"

op_guard_word op_guard_method_word(const char *w)
{
    const char *p;
    if (!strcasecmp(w, "unsafe")) {
        return OPG_WORD_UNSAFE;
    }
    if (!*w || strlen(w) > 32) {
        return OPG_WORD_BAD;
    }
    /* HTTP methods are case-sensitive tokens; every registered one is upper case */
    for (p = w; *p; p++) {
        if (!((*p >= 'A' && *p <= 'Z') || *p == '-' || *p == '_')) {
            return OPG_WORD_BAD;
        }
    }
    return OPG_WORD_METHOD;
}

int op_guard_method_exempt(int unsafe, const char *const *names, int n, const char *method)
{
    int k;
    if (unsafe && strcmp(method, "GET") && strcmp(method, "HEAD")) {
        return 1;
    }
    for (k = 0; k < n; k++) {
        if (!strcmp(names[k], method)) {
            return 1;
        }
    }
    return 0;
}

int op_guard_path_ok(const char *w)
{
    return w[0] == '/' && !strpbrk(w, " \t\r\n?#");
}

int op_guard_path_match(const char *prefix, const char *path)
{
    size_t n = strlen(prefix);
    if (strncmp(prefix, path, n)) {
        return 0;
    }
    return path[n] == '\0' || path[n] == '/' || prefix[n - 1] == '/';
}
