module fewerbits.local/bench/tunem

go 1.26
