#!/usr/bin/env bash
# A short tour of the dynprobe CLI on the bundled example (run by `make demo`).
set -euo pipefail
cd "$(dirname "$0")/.."
DP=.venv/bin/dynprobe
APP=examples/bin/wordcount
step() { printf '\n\033[1m$ %s\033[0m\n' "$*"; "$@"; }

step $DP list $APP
step $DP trace 'p:demo/add_word add_word word=+0(%di):string len=%si:s32' -- $APP
step $DP trace 'p:demo/hash hash' 'p:demo/malloc libc:malloc size=%di:u64' -- $APP "to be or not to be"
step $DP trace --json 'add_word w=+0(%di):string' -- $APP "hello world"
step $DP trace 'add_word+2' -- $APP || true
