#!/usr/bin/env bash
# One line naming this host's CPU and the vector ISAs that decide how vLLM's CPU backend packs
# KV (amx for bf16 where AMX tiles exist, else vec/vec16; neon on ARM): a log says which kind
# of host it proved.
flags=$(grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_tile|amx_bf16|asimd|sve' /proc/cpuinfo 2>/dev/null | sort -u | tr '\n' ' ')
model=$(grep -m1 -E 'model name|^CPU part' /proc/cpuinfo 2>/dev/null | cut -d: -f2 | sed 's/^ *//')
kind="AVX2"; case " $flags" in *" amx_tile "*) kind="AMX";; *" avx512f "*) kind="AVX-512";; esac
[ "$(uname -m)" = aarch64 ] && kind="ARM"
echo "host: $kind ($(uname -m), ${model:-unknown CPU}; flags: ${flags:-none})"
