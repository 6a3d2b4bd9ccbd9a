/* What both C extensions need to share int64 slots between processes: atomic
 * loads, a pause for spinning, a monotonic clock and futex sleeps and wake-ups.
 *
 * Included by synkhronos/runtime/_block.c (the waits) and synkhronos/comm/_reduce.c
 * (the small reductions); setup.py lists it in each extension's depends, so a change
 * here rebuilds both.  Everything is static inline: each extension has its own copy,
 * and neither links against the other.
 */

#ifndef SYNK_ATOMICS_H
#define SYNK_ATOMICS_H

#include <stdint.h>
#include <time.h>
#include <errno.h>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#else
    __asm__ __volatile__("" ::: "memory");
#endif
}

static inline long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline int64_t load(int64_t *p) { return __atomic_load_n(p, __ATOMIC_SEQ_CST); }

static inline int64_t load_acquire(int64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

/* Sleep until the slot changes from ``seen``, a wake-up, a signal or ``ns``; 0 on a signal. */
static inline int futex_wait(int64_t *p, int64_t seen, long long ns) {
#ifdef __linux__
    struct timespec ts = {(time_t)(ns / 1000000000LL), (long)(ns % 1000000000LL)};
    /* The low half of the slot on little-endian machines (the project's targets);
     * any change of a slot we wait on changes its low half within a wait. */
    if (syscall(SYS_futex, (uint32_t *)p, FUTEX_WAIT, (uint32_t)seen, &ts, NULL, 0) < 0 &&
        errno == EINTR)
        return 0;
    return 1;
#else
    struct timespec ts = {0, 50000};
    (void)p; (void)seen; (void)ns;
    return nanosleep(&ts, NULL) == 0;
#endif
}

static inline void futex_wake(int64_t *p) {
#ifdef __linux__
    syscall(SYS_futex, (uint32_t *)p, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
#else
    (void)p;
#endif
}

#endif
