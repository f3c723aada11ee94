/* Functions whose shape decides what an optimized probe may do (hazards 12, 13, 16, 17). */
    .intel_syntax noprefix
    .text

/* Hazard 12: a loop jumps back to entry+2, inside the 5 bytes a jump would replace. */
    .globl jump_into
    .type jump_into, @function
jump_into:                     /* rdi = n: returns n (counts down through entry+2) */
    xor eax, eax               /* 2 bytes */
1:  test rdi, rdi              /* jump_into+2 */
    jz 2f
    add eax, 1
    sub rdi, 1
    jmp 1b
2:  ret
    .size jump_into, .-jump_into

/* Hazard 13: one byte. */
    .globl one_ret
    .type one_ret, @function
one_ret:
    ret
    .size one_ret, .-one_ret

/* Hazard 13: a call within the first 5 bytes (it ends the region: relocated as push + jmp). */
    .globl call_first
    .type call_first, @function
call_first:                    /* returns add_one(rdi) * 2 */
    call add_one
    add rax, rax
    ret
    .size call_first, .-call_first

    .globl add_one
    .type add_one, @function
add_one:
    lea rax, [rdi + 1]
    ret
    .size add_one, .-add_one

/* Hazard 16: a leaf keeps live data in its red zone across the probed instructions. */
    .globl redzone_leaf
    .type redzone_leaf, @function
redzone_leaf:                  /* returns rdi + rsi, through the red zone */
    mov [rsp - 8], rdi
    mov [rsp - 16], rsi
    lea rax, [rdi + rdi]       /* redzone_leaf+10, 4 bytes */
    mov rcx, rax               /* 3 bytes: with the lea, the region the jump replaces */
    mov rax, [rsp - 8]
    add rax, [rsp - 16]
    ret
    .size redzone_leaf, .-redzone_leaf

/* Hazard 17: an IBT entry, called through a pointer. */
    .globl endbr_func
    .type endbr_func, @function
endbr_func:                    /* returns rdi * 3 */
    endbr64
    lea rax, [rdi + rdi * 2]
    nop dword ptr [rax]
    ret
    .size endbr_func, .-endbr_func
    .section .note.GNU-stack, "", @progbits
