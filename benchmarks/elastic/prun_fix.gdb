set pagination off
set breakpoint pending on
break prun_common
run
call (int) pmix_mca_base_framework_open(&prte_ess_base_framework, 0)
continue
