#!/bin/bash
# Every second, for each llama-server and pagedserve server process: its peak RSS (VmHWM), its
# anonymous and file-backed resident pages (RssAnon, RssFile: a mapped GGUF's pages are the
# latter) and the machine's page cache (Cached). Lines "pid VmHWM RssAnon RssFile Cached cmd"
# (kB) go to $1.
out=$1; : > "$out"
while true; do
  cached=$(awk '/^Cached:/{print $2}' /proc/meminfo)
  for pid in $(pgrep -f "llama-server|-m server|pagedserve serve"); do
    s=$(awk '/^(VmHWM|RssAnon|RssFile):/{printf "%s ", $2}' /proc/$pid/status 2>/dev/null)
    cmd=$(tr '\0' ' ' < /proc/$pid/cmdline 2>/dev/null | cut -c1-80)
    [ -n "$s" ] && echo "$pid $s$cached $cmd" >> "$out"
  done
  sleep 1
done
