"""The services every interface calls (CLI, Ansible modules, testbed): each step written once, the
world passed in through a Context."""
