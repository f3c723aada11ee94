#!/usr/bin/env bash
# A short tour of the dynprobe CLI on the bundled example (run by `make demo`).
set -euo pipefail
cd "$(dirname "$0")/.."
DP=.venv/bin/dynprobe
APP=examples/bin/wordcount
# Each command is shown as it could be pasted into a shell (quoted where it needs to be), then run.
shown() {
    local words=() word
    for word in "$@"; do
        if [[ $word =~ ^[A-Za-z0-9_./:=+@%-]+$ ]]; then words+=("$word"); else words+=("'${word//\'/\'\\\'\'}'"); fi
    done
    printf '%s' "${words[*]}"
}
step() { printf '\n\033[1m$ %s\033[0m\n' "$(shown "$@")"; "$@"; }

step $DP list $APP
step $DP trace 'p:demo/add_word add_word word=+0(%di):string len=%si:s32' -- $APP
step $DP trace 'p:demo/hash hash' 'p:demo/malloc libc:malloc size=%di:u64' -- $APP "to be or not to be"
step $DP trace --json 'add_word w=+0(%di):string' -- $APP "hello world"
step $DP trace 'add_word+2' -- $APP || true
step $DP trace --stats --filter 'len > 3' 'p:demo/long add_word word=+0(%di):string len=%si:s32' -- $APP
step $DP count --stats 'p:demo/hash hash' 'p:demo/add add_word' 'p libc:malloc' -- $APP "to be or not to be"
step $DP hist 'p:demo/len add_word len=%si:s32' --value len -- $APP
step $DP trace 'r:demo/hash hash s=+0($arg1):string ret=$retval:u32 ns=$latency:u64' -- $APP "to be or not"
step $DP latency hash add_word --stats -- $APP "to be or not to be that is the question"
step $DP count --top 5 'p libc:mem*' 'p libc:str*' -- examples/bin/app README.md
step $DP trace --trap --stats 'p:demo/hash hash' -- $APP "trap mode, for comparison"
TRACE=$(mktemp -d)/wordcount.data
step $DP record -o "$TRACE" -- $APP "to be or not to be"
step $DP replay "$TRACE"
step $DP report -s calls "$TRACE"
rm -rf "$(dirname "$TRACE")"
