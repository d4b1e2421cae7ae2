"""The drafters of variants with classes of their own (``heads.kinds.VARIANT_CLASSES``), each a subclass of its
kind's drafter, in ``<variant>.py`` with its class named ``DRAFTER`` (found by name: ``drafter_class``)."""
