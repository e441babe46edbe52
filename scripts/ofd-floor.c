/* The embedded backend's floor in C: lock + unlock one byte of a file with Linux
 * open-file-description locks (F_OFD_SETLK), as fast as a loop can.
 * Build and run: cc -O2 -pthread -o /tmp/ofd-floor scripts/ofd-floor.c && /tmp/ofd-floor [seconds] [idle-threads]
 *
 * With idle-threads > 0 the loop runs in a process of that many more threads, which do
 * nothing but wait: Linux then takes and drops a reference to the open file on every
 * fcntl (it skips that in a process of one thread), as it does for any program on a
 * multi-thread runtime. The loop itself is the same. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static void *idle(void *arg) {
    (void)arg;
    for (;;) pause();
    return NULL;
}

int main(int argc, char **argv) {
    double secs = argc > 1 ? atof(argv[1]) : 3.0;
    int idle_threads = argc > 2 ? atoi(argv[2]) : 0;
    for (int i = 0; i < idle_threads; i++) {
        pthread_t t;
        if (pthread_create(&t, NULL, idle, NULL) != 0) { perror("pthread_create"); return 1; }
    }
    char path[] = "/tmp/ofd-floor-XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) { perror("mkstemp"); return 1; }
    unlink(path);
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_whence = SEEK_SET;
    fl.l_start = 12345;
    fl.l_len = 1;
    long n = 0;
    double start = now(), end = start + secs;
    while (1) {
        for (int i = 0; i < 1000; i++) {
            fl.l_type = F_WRLCK;
            if (fcntl(fd, F_OFD_SETLK, &fl) != 0) { perror("lock"); return 1; }
            fl.l_type = F_UNLCK;
            if (fcntl(fd, F_OFD_SETLK, &fl) != 0) { perror("unlock"); return 1; }
        }
        n += 1000;
        if (now() >= end) break;
    }
    printf("%.0f lock+unlock pairs per second (a process of %d thread%s)\n", n / (now() - start),
           1 + idle_threads, idle_threads ? "s" : "");
    return 0;
}
