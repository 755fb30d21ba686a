import factory
from django.contrib.auth import get_user_model

from apps.tasks.models import Task


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        django_get_or_create = ("username",)

    username = factory.Sequence(lambda n: f"user{n}")
    email = factory.LazyAttribute(lambda u: f"{u.username}@example.test")
    password = factory.django.Password("pw-for-tests-only")


class OperatorFactory(UserFactory):
    username = factory.Sequence(lambda n: f"operator{n}")
    is_staff = True
    is_superuser = True


class TaskFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Task

    name = factory.Sequence(lambda n: f"task-{n}")
