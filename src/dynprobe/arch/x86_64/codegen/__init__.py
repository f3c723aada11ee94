"""The machine code dynprobe generates in the target, by what it is: the shared assembler
(asm.py), records and shadow-stack entries in the thread area (records.py), probes' actions
(actions.py), detours of optimized probes and trap actions (detours.py), the return machinery
(returns.py), the function tracer's code (ftrace.py), and clock readers for the tracer itself
(clock.py). Pure: programs, layouts and addresses in, bytes and fix-up tables out."""
