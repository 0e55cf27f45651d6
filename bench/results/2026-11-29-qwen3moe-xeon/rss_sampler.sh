#!/bin/bash
# Samples the peak RSS (VmHWM) of every llama-server and pagedserve process every second;
# prints "name pid peak_kB" lines to $1 as the peaks grow.
out=$1; : > $out
while true; do
  for pid in $(pgrep -f "llama-server|-m server"); do
    hwm=$(awk '/VmHWM/{print $2}' /proc/$pid/status 2>/dev/null)
    cmd=$(tr '\0' ' ' < /proc/$pid/cmdline 2>/dev/null | cut -c1-80)
    [ -n "$hwm" ] && echo "$pid $hwm $cmd" >> $out
  done
  sleep 1
done
