/* The embedded backend's floor in C: lock + unlock one byte of a file with Linux
 * open-file-description locks (F_OFD_SETLK), as fast as a loop can.
 * Build and run: cc -O2 -o /tmp/ofd-floor scripts/ofd-floor.c && /tmp/ofd-floor [seconds] */
#define _GNU_SOURCE
#include <fcntl.h>
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

int main(int argc, char **argv) {
    double secs = argc > 1 ? atof(argv[1]) : 3.0;
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
    printf("%.0f lock+unlock pairs per second\n", n / (now() - start));
    return 0;
}
