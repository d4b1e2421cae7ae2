"""The training objectives of variants with classes of their own (``heads.kinds.VARIANT_CLASSES``), each a
subclass of its kind's objective, in ``<variant>.py`` with its class named ``OBJECTIVE`` (found by name:
``objective_class``)."""
