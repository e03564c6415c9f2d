module libinfer/bindings/go

go 1.19
