"""Generated protobuf/gRPC stubs for package kvsvc.v1. Do not edit: run `make proto`."""
