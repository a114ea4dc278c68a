#!/bin/sh
# Compiler launcher for `pip install .`: pip shows none of a build's output while it runs (only its
# own "Building wheel for sharpi ... " spinner), and the C++/CUDA compile takes minutes on a small
# machine. Each compile announces itself on the user's terminal, on the line below pip's spinner:
#   sharpi: compiling 37/182 forward.cpp
# Nothing is written where there is no terminal (CI, a redirected pip), and the compiler's own
# output, status and arguments are untouched: this script only prints, then execs the compiler.
#
# usage: compile_progress.sh COUNTER_FILE TOTAL COMPILER [ARGS...]
# COUNTER_FILE gains one byte per compile (its size is the count; compiles run in parallel, so two
# may print the same number: it is a progress line, not an account). Written by CMakeLists.txt.
counter=$1
total=$2
shift 2
# The probe runs in a subshell: a failed redirection of the special builtin ':' exits a POSIX
# shell (dash) outright, which would fail the compile it was only meant to announce.
if (: > /dev/tty) 2> /dev/null; then
    printf . >> "$counter"
    n=$(wc -c < "$counter")
    src=
    prev=
    for arg do
        [ "$prev" = -c ] && src=$arg
        prev=$arg
    done
    if [ "$n" -eq 1 ]; then
        printf '\n\033[1A' > /dev/tty  # reserve the line below the spinner (no scroll later)
    fi
    if [ "$n" -ge "$total" ]; then
        line=""  # the last compile: leave the line empty for pip's next messages
    else
        line="  sharpi: compiling $n/$total ${src##*/}"
    fi
    # Save the cursor, go one line down, write, come back: pip's spinner keeps its place.
    printf '\0337\033[1B\r\033[K%s\0338' "$line" > /dev/tty 2> /dev/null
fi
exec "$@"
