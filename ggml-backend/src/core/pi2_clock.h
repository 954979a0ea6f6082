// Monotonic nanoseconds, for the decode and I/O-wait counters.
#pragma once

#include <stdint.h>
#include <time.h>

static inline uint64_t pi2_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t) ts.tv_sec * 1000000000u + (uint64_t) ts.tv_nsec;
}
