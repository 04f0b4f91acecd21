"""The chaos suite (``python -m perf.chaos``, CHAOS.md): ``run`` the fault mix and its phases,
``faults`` what may be injected and what each allows, ``storm`` the poison storm, ``checks`` the
contract and KV accounting every reply is judged by, ``report`` the figures."""
